"""Eval wall time: the batched eval stage against a sequential single-env loop, one run.

    python bench/bench_eval.py --envs 16 --device cuda --policy data/base_policy
    python bench/bench_eval.py --envs 2 --tasks 0 10 --max-macro-steps 3      # a CPU smoke run

"sequential" is the eval stage with one env: reset, query (batch 1), 10 env steps, query
again, episode after episode, as Fast-WAM's own LIBERO eval loop does. "batched" is the
same stage with --envs env processes whose queries are answered together: in lockstep (the
default, eval.lockstep: every batch waits for all running envs, so reruns are bitwise equal)
and async (eval.lockstep false: whoever waits is answered at once, so an env being built
stalls no other). All run the same episodes (same tasks, init states and noise seeds);
success can differ only through float effects of batch composition.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--policy", type=Path, default=None, help="policy dir (default: random init)")
    p.add_argument("--tasks", type=int, nargs="*", default=None, help="task indices (default 40)")
    p.add_argument("--episodes-per-task", type=int, default=1)
    p.add_argument("--max-macro-steps", type=int, default=None, help="cap (default: full budget)")
    p.add_argument("--config", nargs="*", default=[], help="YAML files over default.yaml")
    p.add_argument("--skip-sequential", action="store_true")
    p.add_argument(
        "--context-cache", type=Path, default=None,
        help="a minilm_{len}.safetensors of task contexts (for a machine without the encoder)",
    )  # fmt: skip
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
    try:
        stages.init.main(load_config(args.config, over), run)
        rows = []
        modes = [("batched", args.envs, True), ("batched, async", args.envs, False)]
        if not args.skip_sequential:
            modes.append(("sequential", 1, True))
        for name, envs, lockstep in modes:
            cfg = load_config(args.config, {**over, "eval.envs": envs, "eval.lockstep": lockstep})
            t0 = time.perf_counter()
            stages.eval.main(cfg, run, iteration=0)
            wall = time.perf_counter() - t0
            report = json.loads(paths.eval_json(run, 0).read_text())
            n = sum(t["episodes"] for t in report["tasks"].values())
            rows.append((name, envs, n, wall, report["average"]))
    finally:
        shutil.rmtree(run, ignore_errors=True)
    table = Table(title=f"eval wall time, {args.device}, {len(report['tasks'])} tasks")
    for col in ("mode", "envs", "episodes", "wall s", "episodes/min", "success", "speed-up"):
        table.add_column(col, justify="right")
    slow = rows[-1][3]
    for name, envs, n, wall, avg in rows:
        table.add_row(
            name, str(envs), str(n), f"{wall:.1f}", f"{n / wall * 60:.1f}", f"{avg:.3f}",
            f"{slow / wall:.1f}x",
        )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
