"""Crash-safe replacement (#22 item 1): SIGKILL at every step of every multi-rename write,
then the writer's next run must succeed and leave nothing behind.

Each write runs in a subprocess with WAMRL_FAULT=<point> (wamrl.faults), which kills itself
with SIGKILL there; then the same write runs again in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from tests.stores import REWARD_ATTRS, make_episodes, reward_arrays, write_store
from wamrl import atomic, faults
from wamrl.store import write_reward_group
from wamrl.store_check import validate_store

REPO = Path(__file__).resolve().parents[2]
POINTS = ("temp", "filled", "moved_aside")

WRITE = {
    "reward": (
        "from tests.stores import REWARD_ATTRS, reward_arrays\n"
        "from wamrl.store import write_reward_group\n"
        "write_reward_group(PATH, reward_arrays(3, 2), np.ones(3, bool), REWARD_ATTRS)\n"
    ),
    "store": (
        "from tests.stores import make_episodes, write_store\nwrite_store(PATH, make_episodes(2))\n"
    ),
    "dir": (
        "from wamrl.atomic import atomic_dir, write_text\n"
        "with atomic_dir(PATH) as tmp:\n"
        "    for i in range(3):\n"
        "        write_text(tmp / f'f{i}.txt', 'new')\n"
    ),
}


def killed_write(kind: str, path: Path, point: str) -> None:
    code = f"import numpy as np\nfrom pathlib import Path\nPATH = Path({str(path)!r})\n"
    env = {**os.environ, faults.ENV: point, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, "-c", code + WRITE[kind]], env=env, capture_output=True, text=True
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]


def first_version(kind: str, tmp_path: Path) -> Path:
    if kind == "dir":
        path = tmp_path / "actor"
        with atomic.atomic_dir(path) as tmp:
            atomic.write_text(tmp / "f0.txt", "old")
        return path
    path = write_store(tmp_path / "shard_000.zarr", make_episodes(0))
    if kind == "reward":
        write_reward_group(path, reward_arrays(3, 1), np.ones(3, bool), REWARD_ATTRS)
    return path


def old_content(kind: str, path: Path) -> bytes:
    if kind == "dir":
        return (path / "f0.txt").read_bytes()
    g = zarr.open_group(str(path), mode="r")
    name = "reward/r_rec" if kind == "reward" else "step/chain"
    return np.asarray(g[name][:]).tobytes()


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("kind", sorted(WRITE))
def test_kill_mid_replace_then_rerun(kind: str, point: str, tmp_path: Path) -> None:
    path = first_version(kind, tmp_path)
    killed_write(kind, path, point)
    inner = path / "reward" if kind == "reward" else path
    left = atomic.leftovers(inner)
    assert left, "the kill left no trace: the fault point was not reached"
    if point == "moved_aside":  # the old version is aside and the final name is empty
        assert not inner.exists()
        assert any(".old-" in p.name for p in left)
    else:  # killed before the swap: the old version is still in place, whole
        assert old_content(kind, path) == old_content(kind, first_version(kind, tmp_path / "x"))

    # The writer's next run settles what the kill left, then writes.
    if kind == "reward":
        new = reward_arrays(3, 3)
        write_reward_group(path, new, np.ones(3, bool), REWARD_ATTRS)
        g = zarr.open_group(str(path), mode="r")
        np.testing.assert_array_equal(g["reward/r_rec"][0, :6], new["r_rec"][0, :6])
    elif kind == "store":
        write_store(path, make_episodes(3))
    else:
        with atomic.atomic_dir(path) as tmp:
            atomic.write_text(tmp / "f0.txt", "newest")
        assert (path / "f0.txt").read_text() == "newest"
    if kind != "dir":
        assert validate_store(path) == []
    assert atomic.stale_under(tmp_path) == []


@pytest.mark.parametrize("point", POINTS)
def test_settle_alone_leaves_a_complete_store(point: str, tmp_path: Path) -> None:
    """What the reward stage does first on its next start (the issue's stuck rerun)."""
    path = first_version("reward", tmp_path)
    killed_write("reward", path, point)
    if point != "temp":  # (an empty temp is no zarr node) the leftover shows until settled
        assert validate_store(path) != []
    atomic.settle(path / "reward")
    assert validate_store(path) == []
    assert atomic.stale_under(tmp_path) == []


def test_settle_never_restores_a_half_deleted_old(tmp_path: Path) -> None:
    """A crash while deleting the old version leaves garbage under a tmp name, so a later
    settle (with the final deleted, as Snakemake does before a rerun) does not bring it back."""
    final = tmp_path / "policy"
    final.mkdir()
    old = tmp_path / ".policy.old-0a1b2c3d"
    old.mkdir()
    (old / "model.safetensors").write_text("x")
    atomic._discard(old)
    assert not old.exists() and atomic.leftovers(final) == []
    # An .old with no final, by contrast, is a complete version put aside: restored.
    old.mkdir()
    final.rmdir()
    assert atomic.settle(final) == [old]
    assert final.is_dir() and atomic.leftovers(final) == []


def test_settle_touches_only_its_own_leftovers(tmp_path: Path) -> None:
    mine = [
        ".shard_000.zarr.tmp-abcd1234",
        ".shard_000.zarr.old-abcd1234",
        ".shard_000.zarr.x1y2z3w4.tmp",
    ]
    other = [".shard_001.zarr.tmp-abcd1234", ".shard_000.zarr.tmp", "shard_000.zarr.tmp-abcd1234"]
    for name in mine + other:
        (tmp_path / name).mkdir()
    (tmp_path / "shard_000.zarr").mkdir()
    assert sorted(p.name for p in atomic.settle(tmp_path / "shard_000.zarr")) == sorted(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*other, "shard_000.zarr"])


@pytest.mark.parametrize("mode", ["enospc", "erofs"])
@pytest.mark.parametrize(
    ("kind", "point"),
    [
        ("store", "episode"),
        ("store", "filled"),
        ("reward", "filled"),
        ("dir", "text"),
        ("dir", "filled"),
    ],
)
def test_full_or_read_only_disk_fails_cleanly(
    kind: str, point: str, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails with ENOSPC / EROFS leaves the previous version whole (or nothing,
    for a new artifact) and no temporary behind."""
    path = first_version(kind, tmp_path)
    before = old_content(kind, path)
    monkeypatch.setenv(faults.ENV, f"{point}:{mode}")
    with pytest.raises(OSError, match="injected") as e:
        if kind == "reward":
            write_reward_group(path, reward_arrays(3, 2), np.ones(3, bool), REWARD_ATTRS)
        elif kind == "store":
            write_store(path, make_episodes(2))
        else:
            with atomic.atomic_dir(path) as tmp:
                atomic.write_text(tmp / "f0.txt", "new")
    assert e.value.errno == {"enospc": 28, "erofs": 30}[mode]
    assert old_content(kind, path) == before
    if kind != "dir":
        assert validate_store(path) == []
    assert atomic.stale_under(tmp_path) == []
    if kind == "reward":
        return
    # and a new artifact that fails to write does not appear at all
    fresh = tmp_path / "new" / path.name
    with pytest.raises(OSError, match="injected"):
        if kind == "dir":
            with atomic.atomic_dir(fresh) as tmp:
                atomic.write_text(tmp / "f0.txt", "new")
        else:
            write_store(fresh, make_episodes(2))
    assert not fresh.exists()
    assert atomic.stale_under(tmp_path) == []


def test_a_reward_group_in_progress_does_not_break_readers_of_the_rollout(tmp_path: Path) -> None:
    """The world-model stage validates the rollout part while the reward stage may be
    writing .reward.tmp-* into the same store."""
    path = first_version("reward", tmp_path)
    tmp = atomic.make_temp_dir(path / "reward", 0o755)
    zarr.open_group(str(tmp), mode="w").create_array("r_rec", shape=(3, 6), dtype="float32")
    assert validate_store(path, include_reward=False) == []
    assert any(".reward.tmp-" in p for p in validate_store(path))  # inspect still shows it
