"""Eval stage: deterministic (a = 0, K = 20) success on the LIBERO tasks -> eval.json.

Each task runs `episodes_per_task` episodes from its fixed init states 0, 1, ...; the
initial noise of every query comes from a per-episode seed and every query batch is padded
to one size (run_episodes' fixed_batch), so a rerun reproduces the result exactly, whichever
envs happened to wait together. Optional mp4s of the first `eval.videos` episodes go to
iter_n/eval_videos/.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wamrl import paths
from wamrl.atomic import atomic_dir, write_json
from wamrl.envs.tasks import tasks_in_suites
from wamrl.runtime import pick_device, set_gl_backend


def summarise(tasks, episodes: list[tuple[int, bool, bool]]) -> dict[str, Any]:
    """Per-task and per-suite success rates; the average is over tasks (suites weigh by size).

    episodes: (task index, success, env crashed); a crashed episode counts as a failure and
    is reported per task, so a broken env cannot pass for a weak policy unnoticed."""
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
        }
        suite_rates[t.suite].append(rate)
    suites = {s: float(np.mean(r)) for s, r in suite_rates.items()}
    average = float(np.mean([v["success_rate"] for v in out_tasks.values()]))
    crashed = sum(v["env_crashed"] for v in out_tasks.values())
    return {"tasks": out_tasks, "suites": suites, "average": average, "env_crashed": crashed}


def main(cfg: dict[str, Any], run_dir: Path, iteration: int) -> None:
    set_gl_backend(cfg)
    from stages.reward import checkpoint_sha256
    from wamrl.envs.pool import EnvPool
    from wamrl.rollout import EpisodeSpec, SamplerSettings, load_for_queries, run_episodes

    run_dir = Path(run_dir)
    policy_dir = paths.policy_dir(run_dir, iteration)
    if not (policy_dir / "model.safetensors").is_file():
        raise FileNotFoundError(f"no policy checkpoint at {policy_dir}")
    e, s = cfg["eval"], cfg["sampler"]
    tasks = tasks_in_suites(e["suites"])
    if e["tasks"] is not None:
        tasks = [t for t in tasks if t.index in set(e["tasks"])]
        if not tasks:
            raise ValueError(
                f"eval.tasks {e['tasks']} selects no task of eval.suites {e['suites']}"
            )
    specs = [
        EpisodeSpec(
            task=t,
            init_state=k % t.n_init_states,
            group=t.index,
            record_video=n < e["videos"],
            noise_seed=int(np.random.SeedSequence([e["seed"], t.index, k]).generate_state(1)[0]),
        )
        for n, (t, k) in enumerate((t, k) for t in tasks for k in range(e["episodes_per_task"]))
    ]
    device = pick_device(cfg)
    torch.set_num_threads(1)
    results: list[tuple[int, bool, bool]] = []
    videos: dict[int, np.ndarray] = {}

    def on_episode(i: int, data) -> None:
        results.append((data.task, bool(data.success), bool(data.env_crashed)))
        if data.video_frames is not None:
            videos[i] = data.video_frames

    start = time.time()
    # The pool first: its processes import LIBERO while this one loads the policy.
    with EnvPool(e["envs"], policy_dir / "stats.json", dict(cfg["env"]), seed=e["seed"]) as pool:
        policy, context, mask, normalizer = load_for_queries(policy_dir, device)
        stats = run_episodes(
            policy,
            pool,
            specs,
            context,
            mask,
            normalizer,
            SamplerSettings.from_config(s, K=e["K"], a=0.0),  # eval: pure ODE, its own K
            e["max_macro_steps"],
            seed=e["seed"],
            on_episode=on_episode,
            device=device,
            description=f"eval iter {iteration}",
            lockstep=e["lockstep"],
            record_frames=False,  # eval scores success only: one render per chunk
            fixed_batch=True,  # a row's result independent of its batch: bitwise reruns
        )
    report = {
        "iteration": iteration,
        "checkpoint_sha256": checkpoint_sha256(policy_dir),
        "episodes_per_task": e["episodes_per_task"],
        **summarise(tasks, results),
        "wall_time_s": round(time.time() - start, 2),
        # of which, after the policy loaded: env builds, first resets, graph capture
        "first_query_s": round(stats["first_query_s"], 2) if "first_query_s" in stats else None,
        "config": cfg,
    }
    if videos:
        write_videos(paths.iter_dir(run_dir, iteration) / "eval_videos", videos, specs)
    write_json(paths.eval_json(run_dir, iteration), report)


def write_videos(folder: Path, videos: dict[int, np.ndarray], specs) -> None:
    import imageio.v2 as imageio

    with atomic_dir(folder) as tmp:
        for i, frames in sorted(videos.items()):
            s = specs[i]
            name = f"{s.task.index:02d}_{s.task.name[:60]}_init{s.init_state}.mp4"
            imageio.mimwrite(tmp / name, list(frames), fps=20, macro_block_size=16)
