"""`wamrl status`: the stages done and the next job, read from a run's files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rich.console import Console

from wamrl.status import next_job, print_status, stages_done

ROOT = Path(__file__).resolve().parents[1]


def _touch(path: Path, text: str = "{}") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_stages_done_and_next_job_follow_the_dag(tmp_path: Path) -> None:
    run = tmp_path
    assert next_job(run, 0) == "init"
    _touch(run / "iter_000/policy/checkpoint.json")
    assert stages_done(run, 0) == ["init"] and next_job(run, 0) == "rollout of iteration 1"
    (run / "iter_001/rollouts").mkdir(parents=True)
    assert next_job(run, 1) == "reward of iteration 1"
    _touch(run / "iter_001/reward.done")
    _touch(run / "iter_001/world_model/metrics.json")  # world model ran before the actor
    assert stages_done(run, 1) == ["rollout", "reward", "world_model"]
    assert next_job(run, 1) == "actor of iteration 1"
    _touch(run / "iter_001/actor/metrics.json")
    _touch(run / "iter_001/policy/checkpoint.json")
    _touch(run / "iter_001/eval.json")
    assert stages_done(run, 1)[-2:] == ["merge", "eval"]
    assert next_job(run, 1) == "rollout of iteration 2"


def test_status_of_the_shipped_run_shows_its_numbers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(ROOT / "data" / "rl_object", run)
    console = Console(record=True, width=160)
    print_status(run, console)
    out = console.export_text()
    actor5 = json.loads((run / "iter_005/actor/metrics.json").read_text())
    assert f"{actor5['kl']:.3g}" in out and "epoch 1, mb 0" in out
    assert "0.455 [0.39, 0.52] n=200" in out  # iteration 2's eval, 91/200
    assert "60/128" in out and "15/16" in out  # iteration 1's rollout and groups kept
    assert "last eval: iteration 5, 0.390" in out
