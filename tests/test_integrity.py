"""Integrity end to end (#22): checksummed store chunks, checkpoints verified against their
recorded sha256, every JSON / safetensors artifact read through one helper that names it."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from rich.console import Console
from test_store import REWARD_ATTRS, _chunk_file, _reward_arrays, make_episodes, write_store
from zarr.codecs import Crc32cCodec

from wamrl import store as store_mod
from wamrl.inspect import inspect_store
from wamrl.store import (
    StoreError,
    checksum_coverage,
    load_steps,
    open_store,
    validate_store,
    write_reward_group,
)


def _flip(f: Path, at: int, n: int = 16) -> None:
    """Flip n bytes inside a chunk file, keeping its size (the issue's silent corruption)."""
    data = bytearray(f.read_bytes())
    for i in range(at, at + n):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=300, color_system=None), buf


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    path = write_store(tmp_path / "shard_000.zarr", make_episodes())
    write_reward_group(path, _reward_arrays(3, 0), np.ones(3, bool), REWARD_ATTRS)
    return path


def test_every_array_ends_with_crc32c(shard: Path) -> None:
    root = zarr.open_group(str(shard), mode="r")
    arrays = [p for p, m in root.members(max_depth=None) if isinstance(m, zarr.Array)]
    assert len(arrays) == len(store_mod.SCHEMA)  # the reward group's arrays too
    for p in arrays:
        assert isinstance(root[p].metadata.codecs[-1], Crc32cCodec), p
    assert checksum_coverage(shard) == (sorted(arrays), [])
    console, buf = _console()
    assert inspect_store(shard, console) == 0
    assert f"crc32c on every chunk of all {len(arrays)} arrays" in buf.getvalue()


@pytest.mark.parametrize(
    ("array", "coords"),
    [
        ("step/chain", (1, 0, 0, 0, 0)),  # read whole by validation
        ("step/image", (0, 1, 0, 0, 0)),  # compressed image bytes: validation reads no pixels
        ("reward/advantage", (2, 0)),
        ("episode/success", (0,)),
    ],
)
def test_a_flipped_byte_in_any_chunk_is_caught_by_name(
    shard: Path, array: str, coords: tuple[int, ...]
) -> None:
    f = _chunk_file(shard, array, coords)
    size = f.stat().st_size
    at = max(16, size // 2 - 8)  # past blosc's 16-byte header, before the 4 crc bytes
    _flip(f, at=at, n=min(16, size - 4 - at))
    assert f.stat().st_size == size
    want = f"{array}: 1 chunk file(s) fail their crc32c checksum, first at chunk {coords}"
    assert any(want in p for p in validate_store(shard)), validate_store(shard)
    with pytest.raises(StoreError, match=f"{shard}: not a usable episode store"):
        open_store(shard)
    console, buf = _console()
    assert inspect_store(shard, console) == 1
    assert want in buf.getvalue()


def test_a_read_after_validation_still_names_store_and_array(shard: Path) -> None:
    root = open_store(shard)  # validated, then the bytes change under the reader
    _flip(_chunk_file(shard, "step/chain", (0, 0, 0, 0, 0)), at=40)
    with pytest.raises(StoreError, match=r"shard_000.zarr: array step/chain: unreadable.*checksum"):
        load_steps(root, ["step/chain"])


def test_every_reading_stage_refuses_a_corrupt_chunk_naming_store_and_array(
    shard: Path,
) -> None:
    """reward (open_rollout), actor (load_actor_data), world model (list_windows): each
    stops before any work, its message naming the store and the array."""
    from wamrl.config import load_config
    from wamrl.ppo import load_actor_data
    from wamrl.reward import open_rollout
    from wamrl.world_model import list_windows

    _flip(_chunk_file(shard, "step/frames", (0, 0, 0, 0, 0, 0)), at=100)
    cfg = load_config()
    ctx, mask = torch.zeros(40, 4, 8), torch.ones(40, 4, dtype=torch.bool)
    readers = {
        "reward": lambda: open_rollout(shard),
        "actor": lambda: load_actor_data([shard], ctx, mask, cfg, 1, 2),
        "world_model": lambda: list_windows([shard], cfg["world_model"]),
    }
    for name, read in readers.items():
        with pytest.raises(StoreError) as err:
            read()
        msg = str(err.value)
        assert str(shard) in msg and "step/frames" in msg and "crc32c" in msg, (name, msg)


def test_a_store_from_before_checksums_is_unchecked_not_invalid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_mod, "checksummed", lambda codec: (codec,))
    old = write_store(tmp_path / "old.zarr", make_episodes())
    monkeypatch.undo()
    checked, unchecked = checksum_coverage(old)
    assert checked == [] and "step/chain" in unchecked
    assert validate_store(old, deep=True) == []
    console, buf = _console()
    assert inspect_store(old, console) == 0
    assert "unchecked" in buf.getvalue() and "valid" in buf.getvalue()
