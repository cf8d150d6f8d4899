"""Eval stage: deterministic (a = 0) success on the LIBERO tasks -> eval.json.

eval.protocol picks the settings, resolved in one place (resolve_protocol) and recorded in
eval.json:
- wamrl (default): K = eval.K (20), x_0 of every query drawn from a per-episode generator,
  env.msaa, eval.episodes_per_task, eval.max_macro_steps;
- official: Fast-WAM's LIBERO eval (experiments/libero/eval_libero_single.py at 45d8e14):
  K = 10, x_0 reseeded with 42 at every query (every query starts from the same noise), MSAA
  on, 50 trials per task from init states 0-49, full step budgets, and the ODE steps in the
  model's dtype (bf16 for the fastwam backend's bf16 weights; the tiny backend stays float32).

Each task runs its episodes from the fixed init states 0, 1, ...; every query batch is padded
to one size (run_episodes' fixed_batch), so a rerun reproduces the result exactly, whichever
envs happened to wait together. Where the base checkpoint is a policy directory with its own
eval.json (data/base_policy), its per-task rates are recorded as `reference` and printed
beside the measured ones. Optional mp4s of the first `eval.videos` episodes go to
iter_n/eval_videos/.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wamrl import faults, paths
from wamrl.artifact import read_json
from wamrl.atomic import atomic_dir, write_json
from wamrl.config import (
    EnvSection,
    EvalSection,
    PolicySection,
    SamplerSection,
    resolve_path,
    section,
)
from wamrl.envs.tasks import Task, tasks_in_suites
from wamrl.runtime import pick_device, set_gl_backend
from wamrl.seeding import derive_seed

# Fast-WAM's LIBERO eval (configs/train.yaml and sim_libero.yaml of the official repository):
# eval_num_inference_steps 10, seed 42 passed to every infer_action, EVALUATION.num_trials 50.
OFFICIAL_K = 10
OFFICIAL_NOISE_SEED = 42
OFFICIAL_TRIALS = 50


@dataclass(frozen=True)
class Protocol:
    """eval.protocol resolved to what the stage runs (eval.json's `protocol`)."""

    name: str  # official | wamrl
    K: int  # denoising steps (pure ODE, a = 0)
    noise: str  # per_episode: one generator per episode | reseed_42: x_0 reseeded every query
    msaa: bool  # multisampled rendering
    episodes_per_task: int  # from init states 0 .. episodes_per_task - 1
    max_macro_steps: int | None  # None: the suite's full step budget
    scheduler_dtype: str  # dtype of x_k and the ODE step sizes


def resolve_protocol(cfg: dict[str, Any]) -> Protocol:
    """The one place eval.protocol becomes settings; `official` ignores the eval keys it fixes
    (K, episodes_per_task, max_macro_steps) and env.msaa."""
    e, p = section(cfg, EvalSection), section(cfg, PolicySection)
    if e.protocol == "official":
        # infer_action holds its latents in the model dtype: bf16 for the release weights
        # (validate() requires policy.fastwam, and with it its dtype, with backend fastwam)
        dtype = p.fastwam["dtype"] if p.backend == "fastwam" else "float32"  # type: ignore[index]
        return Protocol("official", OFFICIAL_K, "reseed_42", True, OFFICIAL_TRIALS, None, dtype)
    return Protocol(
        "wamrl", e.K, "per_episode", section(cfg, EnvSection).msaa, e.episodes_per_task,
        e.max_macro_steps, "float32",
    )  # fmt: skip


def episode_noise(protocol: Protocol, eval_seed: int, task: int, k: int) -> tuple[int, bool]:
    """(noise seed, reseed at every query) of a task's k-th episode."""
    if protocol.noise == "reseed_42":
        return OFFICIAL_NOISE_SEED, True
    return derive_seed(eval_seed, task, k), False


def reference_rates(cfg: dict[str, Any], tasks: list[Task]) -> dict[str, Any] | None:
    """The base checkpoint's own eval.json (data/base_policy ships one) for these tasks, so a
    short eval can be read against the base's longer one; None where there is none."""
    base = section(cfg, PolicySection).base_checkpoint
    if base is None or base == "sft":
        return None
    path = resolve_path(base) / paths.EVAL_FILE
    if not path.is_file():
        return None
    ref = read_json(path, "the base checkpoint's eval", keys=("tasks",))
    rates = {t.name: ref["tasks"][t.name]["success_rate"] for t in tasks if t.name in ref["tasks"]}
    return {"source": str(base), "episodes_per_task": ref.get("episodes_per_task"), "tasks": rates}


def success_table(report: dict[str, Any]) -> str:
    """Per-task success beside the reference's, for the stage's output."""
    ref = report.get("reference") or {}
    rates = ref.get("tasks", {})
    n = report["episodes_per_task"]
    lines = [f"{'suite':<15}{'task':<52}{'success':>9}{'base':>7}"]
    for name, v in report["tasks"].items():
        base = f"{rates[name]:.2f}" if name in rates else "-"
        lines.append(f"{v['suite']:<15}{name[:50]:<52}{v['success_rate']:>9.2f}{base:>7}")
    base_avg = f"{np.mean(list(rates.values())):.2f}" if rates else "-"
    lines.append(f"{'average':<67}{report['average']:>9.2f}{base_avg:>7}")
    p = report["protocol"]
    cap = p["max_macro_steps"]
    steps = "full step budgets" if cap is None else f"at most {cap} macro-steps"
    lines.append(f"eval.protocol {p['name']}: {n} episode(s) per task, K = {p['K']}, {steps}.")
    if rates:
        lines.append(
            f"base: {ref['source']}/eval.json, {ref['episodes_per_task']} episodes per task "
            "(init states from 0); a rate over fewer episodes moves in steps of 1/episodes."
        )
    return "\n".join(lines)


def summarise(tasks, episodes: list[tuple[int, bool, bool]]) -> dict[str, Any]:
    """Per-task and per-suite success rates; the average is over tasks (suites weigh by size).

    episodes: (task index, success, env crashed) in episode order; a crashed episode counts
    as a failure and is reported per task, so a broken env cannot pass for a weak policy
    unnoticed. `outcomes` keeps each task's successes in that order: episode k starts from
    init state k and x_0 seed (task, k) whatever the policy, so two evals of one protocol
    pair episode by episode (wamrl.compare)."""
    by_task: dict[int, list[tuple[bool, bool]]] = defaultdict(list)
    for task_index, success, crashed in episodes:
        by_task[task_index].append((success, crashed))
    out_tasks = {}
    suite_rates: dict[str, list[float]] = defaultdict(list)
    for t in tasks:
        res = by_task[t.index]
        rate = float(np.mean([s for s, _ in res])) if res else 0.0
        out_tasks[t.name] = {
            "suite": t.suite,
            "success_rate": rate,
            "episodes": len(res),
            "env_crashed": sum(c for _, c in res),
            "outcomes": [s for s, _ in res],
        }
        suite_rates[t.suite].append(rate)
    suites = {s: float(np.mean(r)) for s, r in suite_rates.items()}
    average = float(np.mean([v["success_rate"] for v in out_tasks.values()]))
    crashed = sum(v["env_crashed"] for v in out_tasks.values())
    return {"tasks": out_tasks, "suites": suites, "average": average, "env_crashed": crashed}


def main(cfg: dict[str, Any], run_dir: Path, iteration: int) -> None:
    set_gl_backend(cfg)
    from wamrl.artifact import checkpoint_sha256
    from wamrl.envs.pool import EnvPool
    from wamrl.plan import EpisodeSpec
    from wamrl.rollout import SamplerSettings, load_for_queries, run_episodes

    run_dir = Path(run_dir)
    policy_dir = paths.policy_dir(run_dir, iteration)
    if not (policy_dir / paths.MODEL_FILE).is_file():
        raise FileNotFoundError(f"no policy checkpoint at {policy_dir}")
    e = section(cfg, EvalSection)
    tasks = tasks_in_suites(e.suites)
    if e.tasks is not None:
        tasks = [t for t in tasks if t.index in set(e.tasks)]
        if not tasks:
            raise ValueError(f"eval.tasks {e.tasks} selects no task of eval.suites {e.suites}")
    protocol = resolve_protocol(cfg)
    specs = []
    for t in tasks:
        for k in range(protocol.episodes_per_task):
            seed, reseed = episode_noise(protocol, e.seed, t.index, k)
            video = len(specs) < e.videos
            specs.append(EpisodeSpec(t, k % t.n_init_states, t.index, video, seed, reseed))
    sampler = replace(
        # eval: pure ODE, its own K
        SamplerSettings.from_config(section(cfg, SamplerSection), K=protocol.K, a=0.0),
        scheduler_dtype=getattr(torch, protocol.scheduler_dtype),
    )
    env_cfg = {**cfg["env"], "msaa": protocol.msaa}  # the env processes take a dict
    device = pick_device(cfg, "eval")
    torch.set_num_threads(1)
    results: dict[int, tuple[int, bool, bool]] = {}  # by spec index: episodes end in any order
    videos: dict[int, np.ndarray] = {}

    def on_episode(i: int, data) -> None:
        results[i] = (data.task, bool(data.success), bool(data.env_crashed))
        faults.point("episode")
        if data.video_frames is not None:
            videos[i] = data.video_frames

    start = time.time()
    # The pool first: its processes import LIBERO while this one loads the policy.
    with EnvPool(e.envs, policy_dir / paths.STATS_FILE, env_cfg, seed=e.seed) as pool:
        policy, context, mask, normalizer = load_for_queries(policy_dir, device)
        stats = run_episodes(
            policy,
            pool,
            specs,
            context,
            mask,
            normalizer,
            sampler,
            protocol.max_macro_steps,
            seed=e.seed,
            on_episode=on_episode,
            device=device,
            description=f"eval iter {iteration}",
            lockstep=e.lockstep,
            record_frames=False,  # eval scores success only: one render per chunk
            fixed_batch=True,  # a row's result independent of its batch: bitwise reruns
        )
    report = {
        "iteration": iteration,
        "checkpoint_sha256": checkpoint_sha256(policy_dir),
        "episodes_per_task": protocol.episodes_per_task,
        "protocol": asdict(protocol),
        **summarise(tasks, [results[i] for i in sorted(results)]),
        "reference": reference_rates(cfg, tasks),
        "wall_time_s": round(time.time() - start, 2),
        # of which, after the policy loaded: env builds, first resets, graph capture
        "first_query_s": round(stats["first_query_s"], 2) if "first_query_s" in stats else None,
        "config": cfg,
    }
    print(success_table(report), flush=True)
    if videos:
        write_videos(paths.eval_videos_dir(run_dir, iteration), videos, specs)
    write_json(paths.eval_json(run_dir, iteration), report)
    from wamrl import tb  # TensorBoard scalars (a warning, never a failure)

    tb.log_scalars(run_dir, "eval", iteration, lambda: tb.eval_scalars(report))


def write_videos(folder: Path, videos: dict[int, np.ndarray], specs) -> None:
    import imageio.v2 as imageio

    with atomic_dir(folder) as tmp:
        for i, frames in sorted(videos.items()):
            s = specs[i]
            name = f"{s.task.index:02d}_{s.task.name[:60]}_init{s.init_state}.mp4"
            imageio.mimwrite(tmp / name, list(frames), fps=20, macro_block_size=16)
