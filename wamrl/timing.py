"""Named-phase timers for benchmarks; off (a few hundred ns per call) unless WAMRL_TIMING is set.

    WAMRL_TIMING=/some/folder wamrl rollout --iter 1 ...

Every process that records phases (the env workers: wamrl/envs/pool.py, libero_env.py) then
writes <folder>/<kind>_<pid>.json when it ends: per phase the seconds and the number of
calls, plus absolute time stamps (time.time(), comparable across processes) of its marks.
bench/bench_iteration.py sets the folder per stage and reads the files back.

    @timing.timed("step")             # a function's every call counts as the phase
    with timing.phase("wait"): ...    # a block
    timing.mark("imported")           # a time stamp
    timing.write("env")               # at the process's end

Phases may nest (a render inside a step): each counts its own wall time, so a reader
subtracts the inner from the outer where it wants exclusive figures.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

ENV = "WAMRL_TIMING"
F = TypeVar("F", bound=Callable[..., Any])


class Phases:
    """Seconds and call counts per phase name, the first and last duration of each, and time
    stamps. The first is kept apart because one-off costs (a cold cache, a GL context's first
    render) land in a phase's first call and vanish in its mean."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.marks: dict[str, float] = {}

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        if self.counts.get(name, 0) == 0:
            self.first[name] = seconds
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + count
        self.last[name] = seconds

    def relabel_last(self, old: str, new: str) -> None:
        """Move the last `old` interval to `new` (e.g. the wait that ended with `close`)."""
        if old in self.last and self.counts.get(old, 0) > 0:
            s = self.last.pop(old)
            self.seconds[old] -= s
            self.counts[old] -= 1
            if self.counts[old] == 0:
                self.first.pop(old, None)
            self.add(new, s)

    def mark(self, name: str) -> None:
        self.marks[name] = time.time()

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "phases": {
                k: {"s": v, "n": self.counts[k], "first": self.first.get(k, 0.0)}
                for k, v in self.seconds.items()
            },
            "marks": dict(self.marks),
        }


_PHASES = Phases()


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def phases() -> Phases:
    """This process's recorder (records whether or not timing is enabled, if called)."""
    return _PHASES


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    if not enabled():
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _PHASES.add(name, time.perf_counter() - t0)


def timed(name: str) -> Callable[[F], F]:
    """Decorator: every call of the function counts as phase `name`."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if not enabled():
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _PHASES.add(name, time.perf_counter() - t0)

        return inner  # type: ignore[return-value]

    return wrap


def mark(name: str) -> None:
    if enabled():
        _PHASES.mark(name)


def relabel_last(old: str, new: str) -> None:
    if enabled():
        _PHASES.relabel_last(old, new)


def write(kind: str, extra: dict[str, Any] | None = None) -> Path | None:
    """Write this process's phases to $WAMRL_TIMING/<kind>_<pid>.json (None: timing off)."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    _PHASES.mark("written")
    path = Path(folder) / f"{kind}_{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"kind": kind, **_PHASES.as_dict(), **(extra or {})}, indent=1))
    os.replace(tmp, path)
    return path


def read_all(folder: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Every record written under `folder` (of one kind, or all)."""
    pattern = f"{kind}_*.json" if kind else "*.json"
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob(pattern))]
