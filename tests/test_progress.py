"""Progress where no live bar can be drawn (stage logs): wamrl.progress.LoggedProgress."""

from __future__ import annotations

import io

from rich.console import Console

from wamrl.progress import progress_bar


def run_bar(terminal: bool, interval: float) -> str:
    out = io.StringIO()
    bar = progress_bar(interval, Console(file=out, force_terminal=terminal, width=120))
    with bar:
        job = bar.add_task("eval iter 0", total=4, info="")
        for i in range(4):
            bar.update(job, advance=1, info=f"success {i}/{i + 1}")
        bar.update(job, info="after the end")  # the final line is printed once
    return out.getvalue()


def test_a_log_gets_a_line_per_interval_and_the_last_one() -> None:
    lines = [ln for ln in run_bar(False, 3600.0).splitlines() if ln.startswith("eval iter 0:")]
    # The first update prints at once, the next two fall inside the interval, the last finishes.
    assert lines[0].startswith("eval iter 0: 1/4 success 0/1  elapsed")
    assert lines[1].startswith("eval iter 0: 4/4 success 3/4  elapsed") and "ETA" not in lines[1]
    assert len(lines) == 2
    every = [ln for ln in run_bar(False, 0.0).splitlines() if ln.startswith("eval iter 0:")]
    assert [ln.split()[3] for ln in every] == ["1/4", "2/4", "3/4", "4/4"]


def test_a_terminal_gets_only_the_live_bar() -> None:
    assert "eval iter 0:" not in run_bar(True, 0.0)
