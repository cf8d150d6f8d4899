"""eval.json's numbers: per-task rates, suite means, the task average and crashed envs."""

from __future__ import annotations

import pytest

from stages.eval import summarise
from wamrl.envs.tasks import load_tasks


def test_summarise_rates_suites_average_and_crashes() -> None:
    tasks = load_tasks()
    chosen = [tasks[0], tasks[1], tasks[30]]  # two spatial tasks, one libero_10
    episodes = [
        (0, True, False), (0, False, False), (0, True, False), (0, False, True),
        (1, False, True), (1, False, False),
        (30, True, False),
    ]  # fmt: skip
    out = summarise(chosen, episodes)
    t0, t1, t30 = (out["tasks"][t.name] for t in chosen)
    assert (t0["success_rate"], t0["episodes"], t0["env_crashed"]) == (0.5, 4, 1)
    assert t0["outcomes"] == [True, False, True, False]  # episode order: wamrl.compare pairs them
    assert (t1["success_rate"], t1["env_crashed"]) == (0.0, 1)
    assert t30["success_rate"] == 1.0
    assert out["suites"] == pytest.approx({"libero_spatial": 0.25, "libero_10": 1.0})
    assert out["average"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert out["env_crashed"] == 2
