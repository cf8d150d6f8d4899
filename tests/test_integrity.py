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
from zarr.codecs import Crc32cCodec

from tests.helpers import micro_cfg
from tests.stores import REWARD_ATTRS, chunk_file, make_episodes, reward_arrays, write_store
from wamrl import store as store_mod
from wamrl.inspect import inspect_store
from wamrl.store import (
    StoreError,
    load_steps,
    open_store,
    write_reward_group,
)
from wamrl.store_check import checksum_coverage, validate_store


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
    write_reward_group(path, reward_arrays(3, 0), np.ones(3, bool), REWARD_ATTRS)
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
    f = chunk_file(shard, array, coords)
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
    _flip(chunk_file(shard, "step/chain", (0, 0, 0, 0, 0)), at=40)
    with pytest.raises(StoreError, match=r"shard_000.zarr: array step/chain: unreadable.*checksum"):
        load_steps(root, ["step/chain"])


@pytest.mark.parametrize(
    ("array", "coords", "at"),
    [("step/frames", (0, 0, 0, 0, 0, 0), 100), ("episode/task", (1,), 16)],
)
def test_every_reading_stage_refuses_a_corrupt_chunk_naming_store_and_array(
    shard: Path, array: str, coords: tuple[int, ...], at: int
) -> None:
    """reward (its success-dominance check, then open_rollout), actor (load_actor_data),
    world model (list_windows): each stops before any work, naming the store and array."""
    from wamrl.config import load_config
    from wamrl.ppo import load_actor_data
    from wamrl.reward import check_success_dominates
    from wamrl.store import open_rollout
    from wamrl.world_model import list_windows

    _flip(chunk_file(shard, array, coords), at=at, n=1)
    cfg = load_config()
    ctx, mask = torch.zeros(40, 4, 8), torch.ones(40, 4, dtype=torch.bool)
    readers = {
        "reward": lambda: open_rollout(shard),
        "actor": lambda: load_actor_data([shard], ctx, mask, cfg, 1, 2),
        "world_model": lambda: list_windows([shard], cfg["world_model"]),
    }
    if array == "episode/task":  # the one array the reward stage reads before validating
        readers["reward's check"] = lambda: check_success_dominates([shard], cfg["reward"])
    for name, read in readers.items():
        with pytest.raises(StoreError) as err:
            read()
        msg = str(err.value)
        assert str(shard) in msg and array in msg and "checksum" in msg, (name, msg)


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


# --------------------------------------------------------------------------- artifacts


def _policy_dir(tmp_path: Path) -> Path:
    """A tiny policy directory as init writes one: weights, contexts, stats, checkpoint.json."""
    import shutil

    from wamrl.artifact import checkpoint_hashes
    from wamrl.atomic import write_json
    from wamrl.config import resolve_path
    from wamrl.policy import build_policy
    from wamrl.policy.text import save_contexts

    cfg = micro_cfg()
    torch.manual_seed(0)
    d = tmp_path / "policy"
    build_policy(cfg).save(d)
    save_contexts(d / "context.safetensors", ["a", "b"], torch.randn(2, 3, 4), torch.ones(2, 3))
    shutil.copy(resolve_path(cfg["policy"]["stats"]), d / "stats.json")
    write_json(d / "checkpoint.json", {**checkpoint_hashes(d), "iteration": 0})
    return d


def _flip_tensor_data(f: Path) -> None:
    """Flip 64 bytes in the tensor data (after the JSON header): the file still loads."""
    header = 8 + int.from_bytes(f.read_bytes()[:8], "little")
    _flip(f, at=header + 1000, n=64)


def test_load_policy_verifies_the_recorded_sha256(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from wamrl.artifact import ArtifactError
    from wamrl.policy import load_policy

    d = _policy_dir(tmp_path)
    record = json_of(d / "checkpoint.json")
    assert set(record["files"]) == {"context.safetensors", "policy.yaml", "stats.json"}
    load_policy(d)  # intact: loads
    _flip_tensor_data(d / "model.safetensors")
    load_file(str(d / "model.safetensors"))  # safetensors alone sees nothing wrong
    with pytest.raises(ArtifactError, match=r"policy/model.safetensors: sha256 .* differs"):
        load_policy(d)


def test_every_recorded_file_is_verified(tmp_path: Path) -> None:
    from wamrl.artifact import ArtifactError, MissingArtifact
    from wamrl.policy import load_policy

    d = _policy_dir(tmp_path)
    stats = (d / "stats.json").read_text()
    (d / "stats.json").write_text(stats.replace("0", "1", 1))
    with pytest.raises(ArtifactError, match=r"policy/stats.json: sha256"):
        load_policy(d)
    (d / "stats.json").unlink()
    with pytest.raises(
        MissingArtifact, match=r"stats.json: recorded in checkpoint.json but missing"
    ):
        load_policy(d)


def json_of(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


@pytest.mark.parametrize("garbage", ["{ not json", "", '{"state": 1'])
def test_a_bad_json_artifact_is_named(tmp_path: Path, garbage: str) -> None:
    """stats.json, eval.json, reward.done, checkpoint.json: the consumer's error names the file."""
    from stages.eval import reference_rates
    from wamrl.artifact import ArtifactError, checkpoint_sha256, read_json
    from wamrl.config import load_config
    from wamrl.envs.conventions import Normalizer
    from wamrl.envs.tasks import load_tasks

    for name in ("stats.json", "eval.json", "reward.done", "checkpoint.json"):
        (tmp_path / name).write_text(garbage)
    with pytest.raises(
        ArtifactError, match=r"stats.json \(normalisation statistics\): not readable"
    ):
        Normalizer.load(tmp_path / "stats.json")
    cfg = load_config(overrides={"policy": {"base_checkpoint": str(tmp_path)}})
    with pytest.raises(ArtifactError, match=r"eval.json .*: not readable JSON"):
        reference_rates(cfg, load_tasks()[:2])
    with pytest.raises(ArtifactError, match=r"reward.done: not readable JSON"):
        read_json(tmp_path / "reward.done")
    with pytest.raises(ArtifactError, match=r"checkpoint.json .*: not readable JSON"):
        checkpoint_sha256(tmp_path)


def test_actor_stage_names_a_damaged_reward_done(tmp_path: Path) -> None:
    import stages.actor
    from wamrl import paths
    from wamrl.artifact import ArtifactError, read_json
    from wamrl.config import load_config

    paths.reward_done(tmp_path, 1).parent.mkdir(parents=True)
    paths.reward_done(tmp_path, 1).write_text('{"groups_kept": 1')  # cut short
    with pytest.raises(ArtifactError, match=r"iter_001/reward.done .*not readable JSON"):
        stages.actor.main(load_config(), tmp_path, 1)
    stats = tmp_path / "stats.json"
    stats.write_text('{"state": {}}')
    with pytest.raises(
        ArtifactError, match=r"stats.json \(statistics\): lacks key\(s\) \['action'\]"
    ):
        read_json(stats, "statistics", keys=("state", "action"))


def test_a_damaged_safetensors_header_is_named(tmp_path: Path) -> None:
    from wamrl.artifact import ArtifactError
    from wamrl.policy import load_policy
    from wamrl.policy.text import load_contexts

    d = _policy_dir(tmp_path)
    ctx = d / "context.safetensors"
    ctx.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage header}" + ctx.read_bytes()[40:])
    with pytest.raises(
        ArtifactError, match=r"context.safetensors \(task contexts\): not a readable"
    ):
        load_contexts(ctx)
    model = d / "model.safetensors"
    model.write_bytes(b"\xff" * 8 + model.read_bytes()[8:])
    (d / "checkpoint.json").unlink()  # nothing recorded: the header itself must be named
    with pytest.raises(ArtifactError, match=r"model.safetensors \(checkpoint\): not a readable"):
        load_policy(d)


def test_safetensors_are_written_readable_by_others(tmp_path: Path) -> None:
    import os

    old = os.umask(0o022)
    try:
        d = _policy_dir(tmp_path)
    finally:
        os.umask(old)
    for f in d.glob("*.safetensors"):
        assert f.stat().st_mode & 0o777 == 0o644, f


def test_verify_run_finds_each_damaged_artifact(tmp_path: Path) -> None:
    """`wamrl verify RUN`: an intact run passes; a flipped byte in a chunk or in tensor
    data, a damaged JSON and a damaged safetensors header are each named."""
    import shutil

    from typer.testing import CliRunner

    from stages.cli import app
    from wamrl import paths
    from wamrl.artifact import save_tensors
    from wamrl.atomic import write_json
    from wamrl.store_check import checksum_problems
    from wamrl.verify import verify_run

    run = tmp_path / "run"
    shutil.copytree(_policy_dir(tmp_path), paths.policy_dir(run, 0))
    shard = write_store(paths.shard_path(run, 1, 0), make_episodes())
    write_json(paths.reward_done(run, 1), {"groups_kept": 1, "groups_total": 2})
    paths.actor_dir(run, 1).mkdir(parents=True)
    save_tensors({"w": torch.ones(3)}, paths.actor_dir(run, 1) / "actor.safetensors")
    write_json(paths.actor_dir(run, 1) / "metrics.json", {"iteration": 1})
    (run / "logs").mkdir()
    (run / "logs" / "x.json").write_text("not an artifact, not checked")

    results = dict(verify_run(run))
    assert set(results) == {
        "iter_001/rollouts/shard_000.zarr", "iter_000/policy (sha256 of its files)",
        "iter_000/policy/checkpoint.json", "iter_000/policy/stats.json",
        "iter_000/policy/model.safetensors", "iter_000/policy/context.safetensors",
        "iter_001/reward.done", "iter_001/actor/actor.safetensors", "iter_001/actor/metrics.json",
    }  # fmt: skip
    assert all(v is None for v in results.values()), results
    assert CliRunner().invoke(app, ["verify", str(run)]).exit_code == 0

    _flip_tensor_data(paths.policy_dir(run, 0) / "model.safetensors")
    _flip(chunk_file(shard, "step/image", (1, 0, 0, 0, 0)), at=5000)
    paths.reward_done(run, 1).write_text('{"groups_kept": ')
    f = paths.actor_dir(run, 1) / "actor.safetensors"
    f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])
    results = dict(verify_run(run))
    assert "model.safetensors: sha256" in results["iter_000/policy (sha256 of its files)"]
    assert (
        "step/image: 1 chunk file(s) fail their crc32c"
        in results["iter_001/rollouts/shard_000.zarr"]
    )
    assert "not readable JSON" in results["iter_001/reward.done"]
    assert "not a readable safetensors" in results["iter_001/actor/actor.safetensors"]
    assert sum(v is not None for v in results.values()) == 4
    assert checksum_problems(shard) == [
        "step/image: 1 chunk file(s) truncated or failing their crc32c, first c/1/0/0/0/0"
    ]
    out = CliRunner().invoke(app, ["verify", str(run)])
    assert out.exit_code == 1 and "5/9 artifacts intact" in out.output


def test_merge_refuses_a_changed_actor_or_lora_tensor(run_after_reward) -> None:
    """actor/ and world_model/ record their files' sha256 (checkpoint.json): merge checks
    them, so a flipped byte is refused, not laundered into a new policy's recorded hash."""
    import shutil

    import stages.actor
    import stages.merge
    import stages.world_model
    from wamrl import paths
    from wamrl.artifact import ArtifactError
    from wamrl.verify import verify_run

    run, cfg = run_after_reward
    stages.actor.main(cfg, run, 1)
    stages.world_model.main(cfg, run, 1)
    for d in (paths.actor_dir(run, 1), paths.world_model_dir(run, 1)):
        files = json_of(d / "checkpoint.json")["files"]
        assert "metrics.json" in files and any(f.endswith(".safetensors") for f in files)
    for f in (
        paths.actor_dir(run, 1) / "actor.safetensors",
        paths.world_model_dir(run, 1) / "lora.safetensors",
    ):
        intact = f.read_bytes()
        _flip_tensor_data(f)
        with pytest.raises(ArtifactError, match=rf"{f.name}: sha256 .* differs"):
            stages.merge.main(cfg, run, 1)
        assert not paths.policy_dir(run, 1).exists()
        problems = [p for _, p in verify_run(run) if p is not None]
        assert len(problems) == 1 and f.name in problems[0]
        f.write_bytes(intact)
    stages.merge.main(cfg, run, 1)
    assert (paths.policy_dir(run, 1) / "checkpoint.json").is_file()
    shutil.rmtree(paths.policy_dir(run, 1))
