"""`wamrl inspect STORE`: summarise an episode store and validate it (exit 1 if invalid)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from rich.console import Console
from rich.table import Table

from wamrl.artifact import ArtifactError, read_json
from wamrl.store import EPISODE_NAMES, REWARD_NAMES
from wamrl.store_check import checksum_coverage, store_sizes, validate_store

_TASK_TABLES = (
    Path("data/tasks.json"),  # the run directory / repo root the CLI runs in
    Path(__file__).resolve().parents[1] / "data" / "tasks.json",  # the source tree's copy
)


def task_names(paths: tuple[Path, ...] = _TASK_TABLES) -> dict[int, str]:
    """index -> name from data/tasks.json ({"tasks": [...]} or a bare list); {} if absent."""
    for p in paths:
        try:
            doc = read_json(p)
        except ArtifactError:  # names are a nicety here: the summary goes on without them
            continue
        rows = doc.get("tasks", []) if isinstance(doc, dict) else doc
        try:
            return {int(r["index"]): str(r["name"]) for r in rows}
        except (TypeError, KeyError, ValueError):
            continue
    return {}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _safe(console: Console, what: str, fn: Callable[[], Any]) -> None:
    """Summaries are best effort: a broken store still gets its validation report."""
    try:
        fn()
    except Exception as e:
        console.print(f"[yellow]could not summarise {what}: {type(e).__name__}: {e}[/]")


def _summary(console: Console, root: zarr.Group) -> dict[str, np.ndarray]:
    ep = {n: root[f"episode/{n}"][:] for n in EPISODE_NAMES}
    E = len(ep["task"])
    attrs = dict(root.attrs)
    head = Table(show_header=False, box=None)
    for key in (
        "iteration",
        "shard",
        "K",
        "G",
        "a",
        "policy_checkpoint",
        "policy_sha256",
        "complete",
    ):
        head.add_row(key, str(attrs.get(key, "[red]missing[/]")))
    L = ep["length"]
    head.add_row("episodes", str(E))
    head.add_row("groups", str(len(np.unique(ep["group"]))))
    head.add_row("success", f"{ep['success'].sum()}/{E} = {ep['success'].mean():.1%}")
    head.add_row(
        "macro-steps",
        f"mean {L.mean():.2f}, min {L.min()}, max {L.max()} (T = {root['step/valid'].shape[1]})",
    )
    head.add_row(
        "video-SFT episodes",
        f"{ep['video_sft'].sum()} ({int(root['video/length'][:].sum())} frames)",
    )
    head.add_row("crashed envs", str(int(ep["env_crashed"].sum())))
    console.print(head)

    names = task_names()
    by_task = Table(title="success by task")
    for col in ("task", "name", "episodes", "success"):
        by_task.add_column(col)
    for t in np.unique(ep["task"]):
        m = ep["task"] == t
        by_task.add_row(
            str(t), names.get(int(t), "?"), str(m.sum()), f"{ep['success'][m].mean():.1%}"
        )
    console.print(by_task)
    return ep


def _reward_summary(console: Console, root: zarr.Group, ep: dict[str, np.ndarray]) -> None:
    if "reward" not in {n for n, _ in root.members()}:
        console.print("reward group: [dim]absent (the reward stage has not run)[/]")
        return
    g = root["reward"]
    rattrs = dict(g.attrs)
    valid = root["step/valid"][:]
    kept = g["group_kept"][:]
    groups = ep["group"]
    n_kept = len(np.unique(groups[kept]))
    console.print(
        f"reward group: present; groups kept {n_kept}/{len(np.unique(groups))}; "
        + ", ".join(
            f"{k}={rattrs.get(k)}" for k in ("beta", "gamma", "rec_mean", "rec_std", "world_model")
        )
    )
    t = Table(title="reward arrays over valid steps")
    for col in ("array", "mean", "std", "min", "max"):
        t.add_column(col)
    for name in REWARD_NAMES:
        x = g[name][:][valid]
        if x.size:
            t.add_row(name, f"{x.mean():.4g}", f"{x.std():.4g}", f"{x.min():.4g}", f"{x.max():.4g}")
    console.print(t)


def _size_summary(console: Console, path: Path) -> None:
    sizes = store_sizes(path)
    t = Table(title="storage")
    for col in ("array", "chunks", "on disk", "uncompressed", "ratio"):
        t.add_column(col, justify="right" if col != "array" else "left")
    tot_disk = tot_raw = 0
    for p, (n, disk, raw) in sizes.items():
        tot_disk += disk
        tot_raw += raw
        t.add_row(
            p, str(n), _fmt_bytes(disk), _fmt_bytes(raw), f"{raw / disk:.2f}x" if disk else "-"
        )
    ratio = f"{tot_raw / tot_disk:.2f}x" if tot_disk else "-"
    t.add_row("[bold]total[/]", "", _fmt_bytes(tot_disk), _fmt_bytes(tot_raw), ratio)
    console.print(t)


def _checksum_summary(console: Console, path: Path) -> None:
    checked, unchecked = checksum_coverage(path)
    if not unchecked:
        console.print(
            f"checksums: crc32c on every chunk of all {len(checked)} arrays "
            "(each chunk file is verified below)"
        )
        return
    # A store from before checksums: valid, but a flipped byte in these arrays goes unseen.
    console.print(
        f"checksums: [yellow]unchecked[/] {len(unchecked)} of {len(checked) + len(unchecked)} "
        f"arrays carry no crc32c (written before checksums): {', '.join(unchecked)}"
    )


def inspect_store(path: str | Path, console: Console | None = None, deep: bool = True) -> int:
    """Print a summary and the validation result; 0 if the store is valid, else 1."""
    console = console or Console()
    path = Path(path)
    console.rule(f"episode store {path}")
    root = None
    if (path / "zarr.json").is_file():
        try:
            root = zarr.open_group(str(path), mode="r", zarr_format=3)
        except Exception as e:
            console.print(f"[red]cannot open as zarr v3: {type(e).__name__}: {e}[/]")
    if root is not None:
        ep: dict[str, np.ndarray] = {}

        def summary() -> None:
            ep.update(_summary(console, root))

        _safe(console, "episodes", summary)
        if ep:
            _safe(console, "reward group", lambda: _reward_summary(console, root, ep))
        _safe(console, "storage", lambda: _size_summary(console, path))
        _safe(console, "checksums", lambda: _checksum_summary(console, path))

    problems = validate_store(path, deep=deep)
    if problems:
        console.print(f"[bold red]INVALID[/]: {len(problems)} problem(s) in {path}")
        for p in problems:
            console.print(f"  - {p}", markup=False, highlight=False)
        return 1
    console.print(f"[bold green]valid[/]: {path} matches the episode-store contract")
    return 0
