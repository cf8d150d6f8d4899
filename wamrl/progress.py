"""Progress bars for the stages: live where a terminal draws them, plain lines in a log."""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class LoggedProgress(Progress):
    """A rich Progress that also reports where no live bar can be drawn (a log file: Snakemake
    jobs, nohup), where rich would print the bar only when it stops: a plain line per task at
    most every `interval` seconds and when it completes."""

    def __init__(self, *columns: Any, interval: float = 60.0, **kwargs: Any):
        super().__init__(*columns, **kwargs)
        self.interval = interval
        self._printed: dict[TaskID, float] = {}

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        if self.console.is_terminal:
            return
        task = self._tasks[task_id]
        now, last = time.monotonic(), self._printed.get(task_id, -math.inf)
        if last == math.inf:  # its final line is out
            return
        if task.finished or now - last >= self.interval:
            self._printed[task_id] = math.inf if task.finished else now
            eta = task.time_remaining
            self.console.print(
                f"{task.description}: {task.completed:.0f}/{task.total:.0f} "
                f"{task.fields.get('info', '')}  elapsed {task.elapsed or 0:.0f} s"
                + ("" if eta is None or task.finished else f", ETA {eta:.0f} s")
            )


def progress_bar(interval: float = 60.0, console: Console | None = None) -> Progress:
    """A bar with an `info` field (e.g. the success count so far) and an ETA."""
    return LoggedProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        interval=interval,
        console=console,
    )
