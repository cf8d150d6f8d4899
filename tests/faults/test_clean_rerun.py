"""Clean reruns (#22 item 2): a stage settles its own leftovers, and only its own, before it
starts; env workers die with a stage killed by -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from stages import cli
from wamrl import atomic, paths
from wamrl.config import load_config

REPO = Path(__file__).resolve().parents[2]

# (stage, kwargs) -> the leftovers a killed run of it leaves (iteration 1, 2 shards).
LEFTOVERS = {
    ("rollout", 0): ["iter_001/rollouts/.shard_000.zarr.tmp-ab12cd34"],
    ("rollout", 1): ["iter_001/rollouts/.shard_001.zarr.tmp-ab12cd34"],
    ("reward", 0): [
        "iter_001/rollouts/shard_000.zarr/.reward.old-ab12cd34",
        "iter_001/rollouts/shard_001.zarr/.reward.tmp-ab12cd34",
        "iter_001/.reward.done.tmp-ab12cd34",
    ],
    ("actor", 0): ["iter_001/.actor.ab12cd34.tmp", "iter_001/.actor.tmp-ab12cd34"],
    ("world_model", 0): ["iter_001/.world_model.ab12cd34.tmp"],
    ("merge", 0): ["iter_001/.policy.tmp-ab12cd34", "iter_001/.policy.old"],
    ("eval", 0): ["iter_001/.eval.json.tmp-ab12cd34", "iter_001/.eval_videos.tmp-ab12cd34"],
}


def make_run(tmp: Path) -> Path:
    for w in range(2):  # complete outputs that the leftovers sit next to
        (tmp / f"iter_001/rollouts/shard_{w:03d}.zarr/reward").mkdir(parents=True)
    for d in ("actor", "world_model", "policy"):
        (tmp / "iter_001" / d).mkdir()
    for files in LEFTOVERS.values():
        for f in files:
            (tmp / f).mkdir(parents=True)
    return tmp


@pytest.mark.parametrize(("stage", "worker"), sorted(LEFTOVERS))
def test_stage_settles_only_its_own_leftovers(
    stage: str, worker: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run(tmp_path)
    seen: list[list[Path]] = []
    fake = types.ModuleType(f"stages.{stage}")
    fake.main = lambda cfg, run_dir, **kw: seen.append(atomic.stale_under(run_dir))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, f"stages.{stage}", fake)
    cfg = load_config(overrides={"rollout": {"workers": 2, "groups": 2}})
    kwargs = {"iteration": 1, **({"worker": worker} if stage == "rollout" else {})}
    before = set(atomic.stale_under(run))
    cli.run_stage(stage, cfg, run, **kwargs)
    mine = {run / f for f in LEFTOVERS[(stage, worker)]}
    # Gone before main ran; every other stage's (and the other worker's) leftovers kept.
    assert seen == [sorted(before - mine)]
    # Complete outputs stay (a .old next to an existing output is garbage, not restored).
    assert (run / "iter_001/policy").is_dir() and (run / "iter_001/actor").is_dir()


def test_stage_outputs_cover_every_stage() -> None:
    for stage in ("init", "demos", "sft", "rollout", "reward", "actor", "world_model", "merge"):
        assert paths.stage_outputs(stage, Path("r"), 1, 0, 2)
    with pytest.raises(ValueError, match="unknown stage"):
        paths.stage_outputs("nope", Path("r"))


POOL = """
import sys, time
from wamrl.envs.pool import EnvPool
from wamrl.envs.tasks import load_tasks
pool = EnvPool(2, {stats!r}, {{"mujoco_gl": "egl"}})
for slot in range(2):  # each worker builds a LIBERO env: seconds of work, deaf to its pipe
    pool.start_episode(slot, load_tasks()[slot], 0)
print(" ".join(str(p) for p in pool.pids()), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_env_workers_die_with_a_killed_stage() -> None:
    """The workers are building their envs when the parent dies (the orphan case in the
    issue): without the parent-death signal they would live on for seconds."""
    code = POOL.format(stats=str(REPO / "data" / "stats.json"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        time.sleep(1.5)  # armed (the first thing a worker does), still busy
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.time() + 3
        while any(_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "an env worker outlived its killed parent"
    finally:
        parent.kill()
