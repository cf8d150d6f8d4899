"""Eval wall time: the batched eval stage against a sequential single-env loop, one run.

    python bench/bench_eval.py --envs 16 40 --device cuda --policy data/base_policy
    python bench/bench_eval.py --envs 2 --tasks 0 10 --max-macro-steps 3      # a CPU smoke run

"sequential" is the eval stage with one env: reset, query (batch 1), 10 env steps, query
again, episode after episode. --fastwam-style adds the loop of Fast-WAM's own LIBERO eval
script (fastwam_style_loop: LIBERO's env with robosuite's defaults, a hard reset per episode
and both cameras rendered on every step), the baseline of issue #7. "batched" is the
same stage with --envs env processes whose queries are answered together: async (the
default, eval.lockstep false: whoever waits is answered at once, so an env being built
stalls no other) and in lockstep (every batch waits for all running envs). All run the
same episodes (same tasks, init states and noise seeds), and both batched rows pad every
batch to --envs rows, so they score the same bits; the sequential rows (batch 1) can
differ through float effects of the batch size. Several --envs counts
each get both batched rows: more env processes than cores can hide the env builds and
the queries (an env waiting for either frees its core), at the price of more processes
sharing the cores. "first query" is the part of the wall time before the first batch was
answered, counted from the episodes' start (after the policy loaded): env builds and
resets, CUDA-graph capture.

Every mode starts from the same compiled-model cache (env.model_cache): --model-cache warm
(default) fills a fresh one with all tasks' scenes before the timer, as after a run's first
eval; cold runs every mode without one (each env build compiles its scene).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def fastwam_style_loop(cfg: dict, run: Path, max_macro_steps: int | None) -> list[bool]:
    """The eval as Fast-WAM's own LIBERO script runs it, one env, one episode after another:
    a fresh LIBERO OffScreenRenderEnv per task (robosuite's defaults: hard reset, both cameras
    rendered on every env step), reset + set_init_state + 30 settle steps, then a batch-1
    query every 10 env steps. Same policy, query path (a CUDA graph where the stage uses
    one), conventions and per-episode noise seeds as the stage; only the env loop differs.
    (Saving its replay mp4s, which Fast-WAM's script also does, is left out.)
    Returns each episode's success."""
    from libero.libero.envs import OffScreenRenderEnv

    from wamrl import paths
    from wamrl.config import SamplerSection, section
    from wamrl.envs import (
        DUMMY_ACTION,
        env_actions,
        image_to_model_input,
        model_image,
        raw_proprio,
        tasks_in_suites,
    )
    from wamrl.graphed import GraphedSampler
    from wamrl.policy.base import Obs
    from wamrl.rollout import SamplerSettings, load_for_queries, query_chunks
    from wamrl.runtime import pick_device

    e, replan = cfg["eval"], cfg["env"]["replan_steps"]
    device = pick_device(cfg)
    policy, context, mask, normalizer = load_for_queries(paths.policy_dir(run, 0), device)
    sampler = SamplerSettings.from_config(section(cfg, SamplerSection), K=e["K"], a=0.0)
    graphed = None
    if sampler.cuda_graphs and device.type == "cuda":
        graphed = GraphedSampler(policy, sampler.K, 0.0, sampler.shift, 1, amp=sampler.amp)
    tasks = [t for t in tasks_in_suites(e["suites"]) if e["tasks"] is None or t.index in e["tasks"]]
    successes = []
    for task in tasks:
        env = OffScreenRenderEnv(
            bddl_file_name=str(task.bddl_path()), camera_heights=256, camera_widths=256
        )
        init_states = task.init_states()
        for k in range(e["episodes_per_task"]):
            seed = int(np.random.SeedSequence([e["seed"], task.index, k]).generate_state(1)[0])
            noise = torch.Generator().manual_seed(seed)
            env.reset()
            obs = env.set_init_state(init_states[k % len(init_states)])
            for _ in range(cfg["env"]["settle_steps"]):
                obs, _, _, _ = env.step(DUMMY_ACTION)
            budget = task.max_steps
            if max_macro_steps is not None:
                budget = min(budget, max_macro_steps * replan)
            success, t = False, 0
            while t < budget and not success:
                image = model_image(obs["agentview_image"], obs["robot0_eye_in_hand_image"])
                state = normalizer.normalize_state(raw_proprio(obs)).astype(np.float32)
                batch = Obs(
                    image_to_model_input(image[None]), torch.from_numpy(state[None]),
                    context[task.index : task.index + 1], mask[task.index : task.index + 1],
                ).to(device)  # fmt: skip
                x0 = torch.randn(1, 32, 7, generator=noise).to(device)
                if graphed is not None:
                    out = graphed.query(batch, noise, x0=x0)
                else:
                    out = query_chunks(policy, batch, sampler, noise, x0=x0)
                chunk = out.chain[0, -1]
                for action in env_actions(chunk.float().cpu().numpy(), normalizer, replan):
                    obs, _, done, _ = env.step(action)
                    t += 1
                    if done or t >= budget:
                        success = bool(done)
                        break
            successes.append(success)
        env.close()
    return successes


def build_env(task_index: int, cfg_env: dict) -> None:
    os.environ["MUJOCO_GL"] = cfg_env["mujoco_gl"]
    from wamrl.envs.libero_env import LiberoEnv
    from wamrl.envs.tasks import load_tasks

    LiberoEnv(load_tasks()[task_index], model_cache=cfg_env["model_cache"]).close()


def fill_model_cache(cfg: dict, processes: int) -> None:
    """Build every eval task's env once (untimed), so that its scene is in the cache."""
    from wamrl.envs.tasks import tasks_in_suites

    tasks = [t.index for t in tasks_in_suites(cfg["eval"]["suites"])]
    if cfg["eval"]["tasks"] is not None:
        tasks = [t for t in tasks if t in set(cfg["eval"]["tasks"])]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(min(processes, len(tasks))) as pool:
        pool.starmap(build_env, [(t, cfg["env"]) for t in tasks])
    print(f"model cache filled: {len(tasks)} scenes in {time.perf_counter() - t0:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", type=int, nargs="+", default=[16], help="env processes, per row")
    p.add_argument("--device", default="cpu")
    p.add_argument("--policy", type=Path, default=None, help="policy dir (default: random init)")
    p.add_argument("--tasks", type=int, nargs="*", default=None, help="task indices (default 40)")
    p.add_argument("--episodes-per-task", type=int, default=1)
    p.add_argument("--max-macro-steps", type=int, default=None, help="cap (default: full budget)")
    p.add_argument("--config", nargs="*", default=[], help="YAML files over default.yaml")
    p.add_argument("--skip-sequential", action="store_true")
    p.add_argument("--fastwam-style", action="store_true",
                   help="add Fast-WAM's own sequential loop (LIBERO env as its script builds it)")  # fmt: skip
    p.add_argument(
        "--context-cache", type=Path, default=None,
        help="a minilm_{len}.safetensors of task contexts (for a machine without the encoder)",
    )  # fmt: skip
    p.add_argument("--model-cache", choices=["warm", "cold"], default="warm")
    args = p.parse_args()
    os.environ.setdefault("MUJOCO_GL", "egl")

    import stages.eval
    import stages.init
    from wamrl import paths
    from wamrl.config import load_config

    over = {
        "device": args.device,
        "eval.tasks": args.tasks,
        "eval.episodes_per_task": args.episodes_per_task,
        "eval.max_macro_steps": args.max_macro_steps,
        "eval.videos": 0,
    }
    if args.policy is not None:
        over["policy.base_checkpoint"] = str(args.policy.resolve())
    run = Path(tempfile.mkdtemp(prefix="bench_eval_"))
    if args.context_cache is not None:
        (run / "context").mkdir()
        shutil.copy(args.context_cache, run / "context" / args.context_cache.name)
    over["env.model_cache"] = None if args.model_cache == "cold" else str(run / "mjb")
    try:
        stages.init.main(load_config(args.config, over), run)
        if args.model_cache == "warm":
            fill_model_cache(load_config(args.config, over), max(args.envs))
        rows = []
        batched = (("batched, lockstep", True), ("batched, async", False))
        modes = [(name, n, lock) for n in args.envs for name, lock in batched]
        if not args.skip_sequential:
            modes.append(("sequential", 1, True))
        for name, envs, lockstep in modes:
            cfg = load_config(args.config, {**over, "eval.envs": envs, "eval.lockstep": lockstep})
            t0 = time.perf_counter()
            stages.eval.main(cfg, run, iteration=0)
            wall = time.perf_counter() - t0
            report = json.loads(paths.eval_json(run, 0).read_text())
            n = sum(t["episodes"] for t in report["tasks"].values())
            first = report["first_query_s"]  # None: no query was answered
            rows.append((name, envs, n, wall, float("nan") if first is None else first,
                         report["average"]))  # fmt: skip
        if args.fastwam_style:  # its own loop, not the stage: no eval.json, no first query
            cfg = load_config(args.config, over)
            t0 = time.perf_counter()
            wins = fastwam_style_loop(cfg, run, args.max_macro_steps)
            wall = time.perf_counter() - t0
            rows.append(("sequential, Fast-WAM style", 1, len(wins), wall, float("nan"),
                         float(np.mean(wins))))  # fmt: skip
    finally:
        shutil.rmtree(run, ignore_errors=True)
    table = Table(title=f"eval wall time, {args.device}, {len(report['tasks'])} tasks")
    cols = ["mode", "envs", "episodes", "wall s", "first query s", "episodes/min", "success"]
    base = {name: wall for name, _, _, wall, _, _ in rows if name.startswith("sequential")}
    cols += [f"speed-up vs {name}" for name in base]
    for col in cols:
        table.add_column(col, justify="right")
    for name, envs, n, wall, first, avg in rows:
        table.add_row(
            name, str(envs), str(n), f"{wall:.1f}", f"{first:.1f}" if first == first else "-",
            f"{n / wall * 60:.1f}", f"{avg:.3f}", *(f"{slow / wall:.1f}x" for slow in base.values()),
        )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
