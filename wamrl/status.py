"""`wamrl status RUN_DIR`: one screen on a run in progress, read from its files.

Per iteration: the stages whose artifacts exist (DAG order rollout -> reward -> actor and
world model -> merge -> eval), rollout success, groups kept, the actor's KL and where a
target-KL stop cut it, and eval success. Below: the last eval, the last actor update and
the next job the DAG would run. report.collect supplies the numbers (one reader of a run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from wamrl import paths
from wamrl.report import collect

# (label, artifact of iteration n) in DAG order; merge's output is the iteration's policy.
STAGES: list[tuple[str, Any]] = [
    ("rollout", lambda run, n: (paths.iter_dir(run, n) / "rollouts").is_dir()),
    ("reward", lambda run, n: paths.reward_done(run, n).is_file()),
    ("actor", lambda run, n: (paths.actor_dir(run, n) / "metrics.json").is_file()),
    ("world_model", lambda run, n: (paths.world_model_dir(run, n) / "metrics.json").is_file()),
    ("merge", lambda run, n: (paths.policy_dir(run, n) / "checkpoint.json").is_file()),
]


def stages_done(run: Path, n: int) -> list[str]:
    """Stages of iteration n whose outputs exist (iteration 0 has init, then maybe eval)."""
    if n == 0:
        done = ["init"] if (paths.policy_dir(run, 0) / "checkpoint.json").is_file() else []
    else:
        done = [name for name, exists in STAGES if exists(run, n)]
    return done + (["eval"] if paths.eval_json(run, n).is_file() else [])


def next_job(run: Path, last: int) -> str:
    """The first stage of the last iteration without its output, else the next rollout."""
    done = stages_done(run, last)
    if last == 0:
        return "init" if "init" not in done else "rollout of iteration 1"
    for name, _ in STAGES:
        if name not in done:
            return f"{name} of iteration {last}"
    return f"rollout of iteration {last + 1}"


def _f(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _eval_cell(avg: dict[str, Any]) -> str:
    lo, hi = avg["ci95"]
    return f"{_f(avg['rate'])} [{_f(lo, '.2f')}, {_f(hi, '.2f')}] n={avg['n']}"


def status_table(run: Path) -> tuple[Table, list[str]]:
    """The per-iteration table and the lines under it."""
    data = collect(run)
    rows = data["iterations"]
    table = Table(title=f"wamrl run {run}", title_justify="left")
    for col in ("it", "stages done", "rollout", "kept", "actor KL", "stop", "eval (95 % CI)"):
        table.add_column(col, justify="left" if col == "stages done" else "right")
    for r in rows:
        n = r["iteration"]
        ro, rw, ac, ev = (r.get(k) for k in ("rollout", "reward", "actor", "eval"))
        stop = (ac or {}).get("early_stop")
        table.add_row(
            str(n),
            " ".join(stages_done(run, n)),
            f"{_f(ro['success'])} ({ro['k']}/{ro['episodes']})" if ro else "-",
            f"{rw['groups_kept']}/{rw['groups_total']}" if rw else "-",
            _f((ac or {}).get("kl"), ".3g"),
            f"epoch {stop['epoch']}, mb {stop['minibatch']}" if stop else ("none" if ac else "-"),
            _eval_cell(ev["average"]) if ev else "-",
        )
    lines = []
    evals = [r for r in rows if r.get("eval")]
    if evals:
        e = evals[-1]
        lines.append(f"last eval: iteration {e['iteration']}, {_eval_cell(e['eval']['average'])}")
    actors = [r for r in rows if r.get("actor")]
    if actors:
        a = actors[-1]["actor"]
        target = f" (target_kl {a['target_kl']:g})" if a.get("target_kl") else ""
        lines.append(
            f"last actor update: iteration {actors[-1]['iteration']}, KL {_f(a['kl'], '.3g')}{target}"
        )
    last = rows[-1]["iteration"] if rows else 0
    lines.append(f"next: {next_job(run, last)}" if rows else "next: init (no iteration yet)")
    return table, lines


def print_status(run: Path, console: Console | None = None) -> None:
    console = console or Console()
    if not Path(run).is_dir():
        raise FileNotFoundError(f"no run directory {run}")
    table, lines = status_table(Path(run))
    console.print(table)
    for line in lines:
        console.print(line)
