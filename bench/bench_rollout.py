"""Rollout throughput against the env-only limit, in one run on the same env processes.

    python bench/bench_rollout.py --envs 2 --episodes 4 --macro-steps 4
    python bench/bench_rollout.py --envs 16 24 --device cuda   # the GPU box (issue #7)

Both modes run the same episodes (one task, init states 0, 1, ...) on one EnvPool whose
processes are created and warmed up first, and render exactly the same frames (query
image, +4 / +8 frames). "env only" answers every query at once with the hold-still action:
the rate the CPU cores allow. "policy" answers with the mixed ODE/SDE sampler over the
tiny model (prefill + K steps, batched over every waiting env), as the rollout stage does;
on CUDA a third row replays each query as a CUDA graph (wamrl/graphed.py), the stage's
default there, and a fourth does so with the model autocast to bf16 (sampler.amp: bf16;
log pi stays float32). Graphs (one per batch bucket) are captured before the timer starts,
as the stage does once per weights; the capture time is printed beside the table. The
eager row is warmed up too (CUDA context, cuBLAS), so every row is steady state.
`--max-batch N ...` adds graphed rows (per --amp dtype) with sampler.max_batch N: envs then
step while other envs are queried. `--compile` adds graphed rows whose layers are
torch.compile'd first (sampler.compile; the compile time is printed with the capture time). Matmuls are full float32 as in the stage (no TF32: the
learner's log pi check would not hold).

Several `--envs` counts each get their own pool and rows, env-only included. More env
processes than cores is how the latency of a large policy hides: while an env waits for its
query, another uses its core. "vs limit" divides by the best env-only rate of any count (what
these cores allow); "vs same envs" by the env-only rate of the row's own pool, measured before
and after its policy rows (the mean of the two: the rate drifts between runs by up to a
quarter on the H200 box). 1.0 means the policy costs nothing. "answering": the share of the wall time the policy process spent
answering queries (near 100 %: the queries, not the envs, set the pace).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]


def env_only(pool, specs, max_macro_steps: int) -> int:
    """Drive the pool with the hold-still action; returns env steps taken."""
    from wamrl.envs.conventions import DUMMY_ACTION
    from wamrl.envs.pool import Crashed, Query, StepResult

    hold = np.repeat(DUMMY_ACTION[None], pool.replan, 0)
    todo, running, steps = list(specs)[::-1], 0, 0
    for slot in range(min(len(pool), len(todo))):
        s = todo.pop()
        pool.start_episode(slot, s.task, s.init_state, s.record_video, max_macro_steps)
        running += 1
    while running:
        for ev in pool.poll(timeout=None):
            if isinstance(ev, Query):
                pool.send_chunk(ev.slot, hold)
            elif isinstance(ev, StepResult | Crashed):
                steps += getattr(ev, "env_steps", 0)
                if isinstance(ev, Crashed) or ev.done:
                    running -= 1
                    if todo:
                        s = todo.pop()
                        pool.start_episode(
                            ev.slot, s.task, s.init_state, s.record_video, max_macro_steps
                        )
                        running += 1
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", type=int, nargs="+", default=[2], help="env processes, per pool")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--macro-steps", type=int, default=4, help="chunks of 10 env steps each")
    p.add_argument("--task", type=int, default=0, help="task index 0..39")
    p.add_argument("--K", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the policy process")
    p.add_argument("--mujoco-gl", default=os.environ.get("MUJOCO_GL", "egl"))
    p.add_argument("--config", nargs="*", default=[], help="YAML files over default.yaml (dims)")
    p.add_argument(
        "--max-batch", type=int, nargs="*", default=[], help="CUDA: sampler.max_batch rows"
    )
    p.add_argument("--amp", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                   help="CUDA: the dtypes of the graphed rows")  # fmt: skip
    p.add_argument("--skip-eager", action="store_true", help="no eager policy row")
    p.add_argument("--compile", action="store_true", help="CUDA: also graphed rows with "
                   "torch.compile'd layers (sampler.compile)")  # fmt: skip
    args = p.parse_args()

    from wamrl.config import load_config
    from wamrl.envs.conventions import Normalizer
    from wamrl.envs.pool import EnvPool
    from wamrl.envs.tasks import load_tasks
    from wamrl.graphed import GraphedSampler
    from wamrl.policy import build_policy
    from wamrl.policy.base import Obs
    from wamrl.rollout import EpisodeSpec, SamplerSettings, query_chunks, run_episodes

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, overrides={"env.mujoco_gl": args.mujoco_gl})
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:  # full-size weights are made on the GPU, not copied there
        policy = build_policy(cfg).eval()
    tasks = load_tasks()
    task = tasks[args.task]
    # Random contexts: speed does not depend on their values, and the bench needs no encoder.
    L = cfg["policy"]["tiny"]["text_max_len"]
    context = torch.randn(len(tasks), L, policy.cfg.text_dim)
    mask = torch.ones(len(tasks), L, dtype=torch.bool)
    stats = REPO / cfg["policy"]["stats"]
    normalizer = Normalizer.load(stats)
    specs = [EpisodeSpec(task, i % task.n_init_states, i) for i in range(args.episodes)]
    console = Console()

    s = cfg["sampler"]
    sampler = SamplerSettings(args.K, s["noise_a"], s["shift"])
    example = Obs(torch.zeros(1, 3, 224, 448), torch.zeros(1, 8), context[:1], mask[:1]).to(device)
    with torch.no_grad():  # eager warm-up: CUDA context, cuBLAS handles, the allocator
        query_chunks(policy, example, sampler, torch.Generator().manual_seed(0))
    graphed: dict[str, GraphedSampler] = {}
    if device.type == "cuda":
        for name, compiled in [(n, c) for c in [False] + [True] * args.compile for n in args.amp]:
            amp = {"fp32": None, "bf16": torch.bfloat16}[name]
            name += ", compiled" if compiled else ""
            graphed[name] = GraphedSampler(
                policy, args.K, s["noise_a"], s["shift"], max(args.envs), amp=amp,
                compile=compiled,
            )  # fmt: skip
            t0 = time.perf_counter()
            n = graphed[name].warm_up(example)
            console.print(f"CUDA graphs, {name}: {n} captured (buckets {graphed[name].buckets})"
                          f" in {time.perf_counter() - t0:.1f} s, before timing")  # fmt: skip

    def policy_run(graphs: GraphedSampler | None = None, max_batch: int | None = None) -> int:
        settings = SamplerSettings(sampler.K, sampler.a, sampler.shift, max_batch=max_batch)
        out = run_episodes(
            policy, pool, specs, context.to(device), mask.to(device), normalizer, settings,
            args.macro_steps, seed=0, on_episode=lambda i, d: None, device=device,
            description="policy", graphed=graphs,
        )  # fmt: skip
        busy.append(out["answer_s"])
        return int(out["env_steps"])

    busy: list[float] = []  # seconds the last policy run spent answering queries
    rows = []  # (mode, envs, env steps, wall s, env-only rate of this pool, answering share)
    for n_envs in args.envs:
        with EnvPool(n_envs, stats, dict(cfg["env"])) as pool:
            env_only(pool, [EpisodeSpec(task, 0, 0)] * n_envs, 1)  # build every env first
            modes = [("env only", lambda: env_only(pool, specs, args.macro_steps))]
            if not args.skip_eager:
                modes.append(("policy", policy_run))
            for name, g in graphed.items():  # the rollout stage's CUDA path (cuda_graphs)
                modes.append((f"policy, CUDA graphs, {name}", lambda g=g: policy_run(g)))
            for cap in args.max_batch:  # the graphs' buckets cover every batch size
                for name, g in graphed.items():
                    modes.append((f"graphs, {name}, batch <= {cap}",
                                  lambda g=g, cap=cap: policy_run(g, cap)))  # fmt: skip
            modes.append(modes[0])  # env only again: the rate drifts, so the rows are bracketed
            measured = []
            for name, fn in modes:
                busy.clear()
                t0 = time.perf_counter()
                steps = fn()
                wall = time.perf_counter() - t0
                measured.append((name, n_envs, steps, wall, sum(busy) / wall))
            own = np.mean(
                [steps / wall for name, _, steps, wall, _ in measured if name == "env only"]
            )
            rows += [(*row[:4], own, row[4]) for row in measured]

    table = Table(
        title=f"rollout throughput: {args.episodes} episodes x {args.macro_steps} macro-steps, "
        f"task {task.index}, K={args.K}, {args.device}, "
        f"{sum(p.numel() for p in policy.parameters()) / 1e6:.1f} M params"
    )
    cols = ("mode", "envs", "env steps", "wall s", "env steps/s", "episodes/h", "vs same envs",
            "vs limit", "answering")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    limit = max(steps / wall for name, _, steps, wall, _, _ in rows if name == "env only")
    for name, n_envs, steps, wall, own, answering in rows:
        rate = steps / wall
        table.add_row(
            name, str(n_envs), str(steps), f"{wall:.2f}", f"{rate:.1f}",
            f"{args.episodes / wall * 3600:.0f}", f"{rate / own:.3f}", f"{rate / limit:.3f}",
            f"{answering:.0%}" if name != "env only" else "",
        )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
