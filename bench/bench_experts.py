"""Success table of the scripted experts (wamrl.experts) on LIBERO tasks.

    python bench/bench_experts.py --init-states 3 --workers 2 --out runs/experts.json
    python bench/bench_experts.py --init-states 10 --tasks 0-9 20 27 --out spatial.json

Each episode: env.reset(init_state), expert.reset(env), then expert.act / env.step until
LIBERO reports success, the expert is done, or task.max_steps run out (physics only, no
rendering). Tasks without an expert (not in SUPPORTED) are run anyway with --all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_tasks(specs: list[str]) -> list[int]:
    out: list[int] = []
    for spec in specs:
        for part in spec.split(","):
            if "-" in part:
                a, b = part.split("-")
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    return out


def run_task(task_index: int, init_states: list[int], run_all: bool) -> dict:
    os.environ.setdefault("MUJOCO_GL", "egl")
    from wamrl.envs.libero_env import LiberoEnv
    from wamrl.envs.tasks import load_tasks
    from wamrl.experts import SUPPORTED, Expert, make_expert

    task = load_tasks()[task_index]
    row = {
        "index": task.index,
        "suite": task.suite,
        "name": task.name,
        "language": task.language,
        "supported": task.index in SUPPORTED,
        "episodes": [],
    }
    if task.index not in SUPPORTED and not run_all:
        return row
    expert = make_expert(task) if task.index in SUPPORTED else Expert(task)
    t0 = time.perf_counter()
    with LiberoEnv(task, render_size=64) as env:
        for init in init_states:
            env.reset(init)
            expert.reset(env)
            success, steps, error = False, 0, None
            try:
                while steps < task.max_steps and not expert.done:
                    success = env.step(expert.act(env))
                    steps += 1
                    if success:
                        break
            except Exception as exc:  # a plan that cannot be built counts as a failure
                error = f"{type(exc).__name__}: {exc}"
            row["episodes"].append(
                {
                    "init_state": init,
                    "success": bool(success),
                    "steps": steps,
                    "error": error,
                    "log": list(expert.log),
                }
            )
    row["seconds"] = time.perf_counter() - t0
    return row


def summarise(rows: list[dict]) -> dict:
    suites: dict[str, list[float]] = {}
    for r in rows:
        eps = r["episodes"]
        r["n"] = len(eps)
        r["successes"] = sum(e["success"] for e in eps)
        r["success_rate"] = r["successes"] / r["n"] if eps else 0.0
        ok = [e["steps"] for e in eps if e["success"]]
        r["mean_steps"] = sum(ok) / len(ok) if ok else None
        suites.setdefault(r["suite"], []).append(r["success_rate"])
    return {s: sum(v) / len(v) for s, v in suites.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--init-states", type=int, default=3, help="init states 0..N-1 per task")
    p.add_argument("--first-init", type=int, default=0)
    p.add_argument("--tasks", nargs="*", default=["0-39"], help="indices / ranges, e.g. 0-9 27")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--all", action="store_true", help="also run tasks not in SUPPORTED")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    tasks = parse_tasks(args.tasks)
    inits = list(range(args.first_init, args.first_init + args.init_states))
    t0 = time.perf_counter()
    if args.workers <= 1:
        rows = [run_task(t, inits, args.all) for t in tasks]
    else:
        with ProcessPoolExecutor(args.workers) as pool:
            rows = list(pool.map(run_task, tasks, [inits] * len(tasks), [args.all] * len(tasks)))
    suites = summarise(rows)

    table = Table(title=f"scripted experts, init states {inits[0]}..{inits[-1]}")
    for col in ("#", "suite", "task", "success", "mean steps", "notes"):
        table.add_column(col)
    for r in rows:
        if not r["episodes"]:
            table.add_row(str(r["index"]), r["suite"], r["language"], "-", "-", "no expert")
            continue
        notes = sorted({e["error"] for e in r["episodes"] if e["error"]})
        steps = f"{r['mean_steps']:.0f}" if r["mean_steps"] is not None else "-"
        colour = "green" if r["success_rate"] >= 0.8 else "yellow" if r["success_rate"] else "red"
        table.add_row(
            str(r["index"]),
            r["suite"],
            r["language"],
            f"[{colour}]{r['successes']}/{r['n']}[/{colour}]",
            steps,
            "; ".join(notes)[:60],
        )
    console = Console(width=160)
    console.print(table)
    for s, v in suites.items():
        console.print(f"{s:15s} mean success {v:.2f}")
    total = sum(r["successes"] for r in rows) / max(1, sum(r["n"] for r in rows))
    console.print(f"all tasks      mean success {total:.2f}  ({time.perf_counter() - t0:.0f} s)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"init_states": inits, "tasks": rows, "suites": suites, "overall": total}
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
