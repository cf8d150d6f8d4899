"""Episode store (wamrl.store) and `wamrl inspect` on synthetic episodes (no LIBERO; built
by tests/stores.py)."""

from __future__ import annotations

import io
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import zarr
from rich.console import Console

from tests.stores import (
    LENGTHS,
    REWARD_ATTRS,
    TV,
    K,
    T,
    chunk_file,
    make_episode,
    make_episodes,
    reward_arrays,
    store_attrs,
    write_store,
)
from wamrl import faults
from wamrl.inspect import inspect_store
from wamrl.store import (
    CORE_GROUPS,
    IMAGE_T_CHUNK,
    REWARD_NAMES,
    SCHEMA,
    EpisodeData,
    ShardWriter,
    StoreError,
    load_steps,
    open_store,
    read_episode_table,
    write_reward_group,
)
from wamrl.store_check import store_sizes, validate_store


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, list[EpisodeData]]:
    eps = make_episodes()
    return write_store(tmp_path / "shard_000.zarr", eps), eps


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, color_system=None), buf


def test_constants_match_policy_interface() -> None:
    from wamrl import contract as base
    from wamrl import store

    assert (store.CHUNK_LEN, store.ACTION_DIM, store.PROPRIO_DIM, store.IMAGE_HW) == (
        base.CHUNK_LEN,
        base.ACTION_DIM,
        base.PROPRIO_DIM,
        base.IMAGE_HW,
    )


def test_round_trip(store: tuple[Path, list[EpisodeData]]) -> None:
    path, eps = store
    assert validate_store(path, deep=True) == []
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp left behind
    root = open_store(path)
    E = len(eps)
    for spec in SCHEMA:
        if spec.group == "reward":
            continue
        arr = root[spec.path]
        assert tuple(arr.metadata.dimension_names) == spec.dims, spec.path
        assert str(arr.dtype) == spec.dtype
        assert arr.shape == spec.shape(E, T, K, TV)
    attrs = dict(root.attrs)
    for key, value in store_attrs().items():
        assert attrs[key] == value
    assert attrs["complete"] is True and attrs["schema_version"] == 1

    for i, ep in enumerate(eps):
        n = ep.length
        assert root["episode/length"][i] == n
        np.testing.assert_array_equal(root["step/valid"][i], np.arange(T) < n)
        np.testing.assert_array_equal(root["step/done"][i], np.arange(T) == n - 1)
        for name in ("image", "proprio", "chain", "k_star", "logp_old", "frames", "r_task"):
            got = root[f"step/{name}"][i]
            np.testing.assert_array_equal(got[:n], getattr(ep, name))
            assert not got[n:].any(), f"padding of step/{name} must be zero"
        nv = 0 if ep.video_frames is None else len(ep.video_frames)
        assert root["video/length"][i] == nv
        if nv:
            np.testing.assert_array_equal(root["video/frames"][i, :nv], ep.video_frames)
            np.testing.assert_array_equal(root["video/proprio"][i, :nv], ep.video_proprio)

    table = read_episode_table(path)
    for name in ("task", "init_state", "group", "success", "video_sft", "env_crashed"):
        np.testing.assert_array_equal(table[name], [getattr(e, name) for e in eps])
    np.testing.assert_array_equal(table["length"], LENGTHS)

    arrays, ep_idx, step_idx = load_steps(path, ["chain", "step/k_star", "image"])
    assert len(ep_idx) == sum(LENGTHS)
    np.testing.assert_array_equal(ep_idx, np.repeat(np.arange(E), LENGTHS))
    np.testing.assert_array_equal(step_idx, np.concatenate([np.arange(n) for n in LENGTHS]))
    for n in range(len(ep_idx)):
        e, s = ep_idx[n], step_idx[n]
        np.testing.assert_array_equal(arrays["step/chain"][n], eps[e].chain[s])
        np.testing.assert_array_equal(arrays["step/image"][n], eps[e].image[s])
    sub, ep_sub, _ = load_steps(path, ["logp_old"], only_valid=False, episodes=[2])
    assert sub["step/logp_old"].shape == (T,) and set(ep_sub) == {2}

    files, _, raw = store_sizes(path)["step/image"]
    chunks = [math.ceil(n / IMAGE_T_CHUNK) for n in LENGTHS]
    assert files == sum(chunks)
    stored_steps = sum(min(c * IMAGE_T_CHUNK, T) for c in chunks)  # edge chunks clipped at T
    assert raw == stored_steps * 224 * 448 * 3

    console, buf = _console()
    assert inspect_store(path, console) == 0
    out = buf.getvalue()
    assert "1/3 = 33.3%" in out and "valid" in out
    assert "mean 3.33, min 1, max 6" in out


def test_rewrite_replaces_existing_store(tmp_path: Path) -> None:
    path = write_store(tmp_path / "s.zarr", make_episodes(0))
    new = make_episodes(1)
    write_store(path, new)
    np.testing.assert_array_equal(open_store(path)["step/chain"][0, : LENGTHS[0]], new[0].chain)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def test_half_written_store_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "shard_000.zarr"
    w = ShardWriter(path, 3, T, K, TV, store_attrs())
    for i, ep in enumerate(make_episodes()):
        w.write_episode(i, ep)
    # The writer died before close(): only the hidden temp exists.
    problems = validate_store(path)
    assert len(problems) == 1 and "does not exist" in problems[0] and "half-written" in problems[0]
    with pytest.raises(StoreError, match="shard_000.zarr"):
        open_store(path)
    tmp_problems = validate_store(w.tmp)
    assert any("complete" in p for p in tmp_problems)
    console, buf = _console()
    assert inspect_store(w.tmp, console) == 1
    assert "half-written" in buf.getvalue()
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_missing_complete_attr(store: tuple[Path, list[EpisodeData]]) -> None:
    path, _ = store
    root = zarr.open_group(str(path), mode="r+")
    del root.attrs["complete"]
    with pytest.raises(StoreError, match="half-written"):
        open_store(path)
    console, buf = _console()
    assert inspect_store(path, console) == 1
    assert "`complete` is missing" in buf.getvalue()


def test_writer_abort_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "shard.zarr"
    eps = make_episodes()
    with (
        pytest.raises(RuntimeError, match="env died"),
        ShardWriter(path, 3, T, K, TV, store_attrs()) as w,
    ):
        w.write_episode(0, eps[0])
        raise RuntimeError("env died")
    assert list(tmp_path.iterdir()) == []
    # An aborted rewrite keeps the old complete store untouched.
    write_store(path, eps)
    with pytest.raises(RuntimeError), ShardWriter(path, 3, T, K, TV, store_attrs()) as w:
        raise RuntimeError("again")
    assert validate_store(path) == [] and sorted(p.name for p in tmp_path.iterdir()) == [
        "shard.zarr"
    ]


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    eps = make_episodes()
    w = ShardWriter(tmp_path / "s.zarr", 3, T, K, TV, store_attrs())
    bad = make_episode(np.random.default_rng(0), 2, False)
    bad.chain = bad.chain[:, :K]  # K chain states instead of K + 1
    with pytest.raises(ValueError, match="chain"):
        w.write_episode(0, bad)
    w.write_episode(0, eps[0])
    with pytest.raises(StoreError, match=r"episodes \[1, 2\] were never written"):
        w.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="policy_sha256"):
        ShardWriter(
            tmp_path / "s.zarr",
            3,
            T,
            K,
            TV,
            {k: v for k, v in store_attrs().items() if k != "policy_sha256"},
        )


def test_background_writer_writes_the_same_store(tmp_path: Path) -> None:
    """The writer thread (a queue of 1, so the caller also waits on a full queue) writes the
    same store as the inline writer, byte for byte: every file, every array, every attr."""
    eps = make_episodes(0) + [replace(ep, group=ep.group + 2) for ep in make_episodes(1)]
    inline = write_store(tmp_path / "inline" / "s.zarr", eps)
    threaded = write_store(tmp_path / "threaded" / "s.zarr", eps, max_queued=1)
    assert validate_store(threaded, deep=True) == []
    a, b = open_store(inline), open_store(threaded)
    assert dict(a.attrs) == dict(b.attrs)
    members = dict(a.members(max_depth=None))  # every group and array, nested ones too
    assert members.keys() == dict(b.members(max_depth=None)).keys()
    assert {n for n, x in members.items() if isinstance(x, zarr.Array)} == {
        spec.path for spec in SCHEMA if spec.group in CORE_GROUPS
    }
    for name, x in members.items():
        y = b[name]
        assert dict(x.attrs) == dict(y.attrs), name
        if isinstance(x, zarr.Array):
            assert (x.chunks, x.dtype, x.metadata) == (y.chunks, y.dtype, y.metadata), name
            np.testing.assert_array_equal(x[...], y[...], err_msg=name)
    files = {p.relative_to(inline): p for p in inline.rglob("*") if p.is_file()}
    assert files.keys() == {p.relative_to(threaded) for p in threaded.rglob("*") if p.is_file()}
    for rel, f in files.items():
        assert f.read_bytes() == (threaded / rel).read_bytes(), rel


def test_background_writer_error_stops_the_caller_and_leaves_no_store(tmp_path: Path) -> None:
    """A bad episode fails in the writer thread: the next write_episode raises that error
    (with a note naming the episode), the with block removes the temp store."""
    path = tmp_path / "shard.zarr"
    eps = make_episodes()
    bad = make_episode(np.random.default_rng(0), 2, False)
    bad.chain = bad.chain[:, :K]  # K chain states instead of K + 1
    with (
        pytest.raises(ValueError, match="chain") as err,
        ShardWriter(path, 3, T, K, TV, store_attrs(), max_queued=2) as w,
    ):
        w.write_episode(0, eps[0])
        w.write_episode(1, bad)
        deadline = time.monotonic() + 30
        while w._error is None and time.monotonic() < deadline:  # the thread reaches it
            time.sleep(0.01)
        w.write_episode(2, eps[2])  # raises: the loop stops here, not after every episode
        pytest.fail("write_episode went on after the writer thread failed")
    assert any("episode 1" in note for note in err.value.__notes__)
    assert w._thread is None  # joined before the temp went: nothing can write into it again
    assert list(tmp_path.iterdir()) == []


def test_background_writer_error_at_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error in the last episode's write is raised by close(), as the error itself (a
    full disk stays an OSError with its errno); no store, complete or not, is left."""
    monkeypatch.setenv(faults.ENV, "episode:enospc")  # the first episode written fails
    path = tmp_path / "shard.zarr"
    with pytest.raises(OSError, match="injected") as err:
        write_store(path, make_episodes()[:1], max_queued=4)
    assert err.value.errno == 28
    assert any("episode 0" in note for note in err.value.__notes__)
    assert list(tmp_path.iterdir()) == []


def test_background_writer_abort_drops_the_queue(tmp_path: Path) -> None:
    path = tmp_path / "shard.zarr"
    eps = make_episodes()
    with (
        pytest.raises(RuntimeError, match="env died"),
        ShardWriter(path, 3, T, K, TV, store_attrs(), max_queued=3) as w,
    ):
        for i, ep in enumerate(eps):
            w.write_episode(i, ep)
        raise RuntimeError("env died")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(StoreError, match="already closed"):
        w.write_episode(0, eps[0])


def test_deleted_and_truncated_chunks_are_reported(store: tuple[Path, list[EpisodeData]]) -> None:
    path, _ = store
    image_chunk = chunk_file(path, "step/image", (0, 1, 0, 0, 0))  # episode 0, steps 4..5
    image_chunk.unlink()
    problems = validate_store(path)
    assert any("step/image: 1 chunk file(s) missing" in p for p in problems), problems
    with pytest.raises(StoreError, match="missing"):
        open_store(path)

    small_chunk = chunk_file(path, "episode/success", (2,))
    small_chunk.unlink()
    assert any("episode/success: 1 chunk file(s) missing" in p for p in validate_store(path))


def test_truncated_chunk_is_reported(store: tuple[Path, list[EpisodeData]]) -> None:
    path, _ = store
    f = chunk_file(path, "step/frames", (1, 0, 0, 0, 0, 0))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    problems = validate_store(path)
    assert any("step/frames: 1 chunk file(s) truncated" in p for p in problems), problems
    deep = validate_store(path, deep=True)
    assert any("step/frames: episode 1 unreadable" in p for p in deep), deep
    console, _ = _console()
    assert inspect_store(path, console) == 1


def test_wrong_dtype_and_dims_are_reported(store: tuple[Path, list[EpisodeData]]) -> None:
    path, _ = store
    root = zarr.open_group(str(path), mode="r+")
    task = root["episode/task"][:]
    del root["episode/task"]
    root.create_array(
        "episode/task", data=task.astype(np.int64), chunks=(1,), dimension_names=("episode",)
    )
    del root["step/k_star"]
    root.create_array(
        "step/k_star", shape=(3, T), dtype="int32", chunks=(1, T), dimension_names=("ep", "t")
    )
    root.create_array("step/extra/deep", shape=(3,), dtype="int8", dimension_names=("episode",))
    problems = validate_store(path)
    assert "episode/task has dtype int64, the contract says int32" in problems
    assert "unexpected array step/extra/deep: not in the contract" in problems
    assert any(p.startswith("step/k_star has dimension_names") for p in problems), problems


@pytest.mark.parametrize(
    ("array", "index", "value", "message"),
    [
        ("step/valid", (1, 1), False, "step/valid is not a prefix"),
        ("step/done", (0, 2), True, "step/done must be True exactly at its last valid step"),
        ("step/k_star", (0, 0), 0, "step/k_star outside 1..3"),
        ("step/k_star", (0, 1), K, "step/k_star outside 1..3"),
        ("step/logp_old", (1, 0), np.nan, "step/logp_old is not finite"),
        ("step/r_task", (1, 2), 1.0, "step/r_task has a 1 but episode/success is False"),
        ("step/r_task", (0, 5), 0.0, "success but step/r_task is not 1"),
        ("step/r_task", (2, 3), 1.0, "nonzero at padding"),
        ("step/chain", (0, 1, 2, 3, 4), np.inf, "step/chain holds non-finite"),
        ("episode/env_crashed", (0,), True, "success and env_crashed are both True"),
        ("episode/task", (1,), 9, "group 0: members differ"),
        ("video/length", (0,), 2, "video frames recorded but episode/video_sft is False"),
    ],
)
def test_invalid_masks_are_caught(
    store: tuple[Path, list[EpisodeData]], array: str, index: tuple, value: object, message: str
) -> None:
    path, _ = store
    assert validate_store(path) == []
    zarr.open_array(str(path / array), mode="r+")[index] = value
    problems = validate_store(path)
    assert any(message in p for p in problems), problems


def test_reward_group_rewrite(store: tuple[Path, list[EpisodeData]]) -> None:
    path, _ = store
    arrays = reward_arrays(3, 0)
    kept = np.array([True, True, False])
    valid = open_store(path)["step/valid"][:]

    def read() -> dict[str, np.ndarray]:
        g = open_store(path)["reward"]
        return {n: g[n][:] for n in (*REWARD_NAMES, "group_kept")}

    write_reward_group(path, arrays, kept, REWARD_ATTRS)
    first = read()
    write_reward_group(path, arrays, kept, REWARD_ATTRS)
    second = read()
    for n in first:
        np.testing.assert_array_equal(first[n], second[n])
    for n in REWARD_NAMES:
        np.testing.assert_array_equal(first[n], np.where(valid, arrays[n], 0))
    np.testing.assert_array_equal(first["group_kept"], kept)
    root = open_store(path)
    got, ep_idx, step_idx = load_steps(
        root, ["reward/advantage"]
    )  # an open group: no re-validation
    np.testing.assert_array_equal(got["reward/advantage"], arrays["advantage"][ep_idx, step_idx])
    np.testing.assert_array_equal(read_episode_table(root)["group_kept"], kept)
    assert validate_store(path, deep=True) == []
    g = open_store(path)["reward"]
    assert dict(g.attrs)["groups_kept"] == 1 and dict(g.attrs)["groups_total"] == 2
    assert sorted(n for n, _ in open_store(path).members()) == [
        "episode",
        "reward",
        "step",
        "video",
    ]

    # A rerun with other values replaces the group whole.
    other = reward_arrays(3, 1)
    write_reward_group(path, other, np.ones(3, bool), REWARD_ATTRS)
    np.testing.assert_array_equal(read()["advantage"], np.where(valid, other["advantage"], 0))
    # A crash mid-write leaves .reward.tmp-*: reported, then cleaned by the next run.
    zarr.open_group(str(path), mode="r+").create_group(".reward.tmp-0a1b2c3d").create_array(
        "r_rec", shape=(3, T), dtype="float32"
    )
    assert any(
        ".reward.tmp-0a1b2c3d/r_rec" in p and "interrupted" in p for p in validate_store(path)
    )
    write_reward_group(path, other, np.ones(3, bool), REWARD_ATTRS)
    assert validate_store(path) == []

    console, buf = _console()
    assert inspect_store(path, console) == 0
    assert "groups kept 2/2" in buf.getvalue()


def test_reward_group_checks(store: tuple[Path, list[EpisodeData]]) -> None:
    path, _ = store
    bad = reward_arrays(3, 0)
    bad["return"][0, 0] = np.nan  # valid step
    with pytest.raises(ValueError, match="reward/return: non-finite"):
        write_reward_group(path, bad, np.ones(3, bool), REWARD_ATTRS)
    with pytest.raises(ValueError, match="group_kept"):
        write_reward_group(path, reward_arrays(3, 0), np.ones(2, bool), REWARD_ATTRS)
    write_reward_group(path, reward_arrays(3, 0), np.ones(3, bool), REWARD_ATTRS)
    zarr.open_array(str(path / "reward/group_kept"), mode="r+")[1] = False  # group 0 split
    assert any("group_kept differs within group 0" in p for p in validate_store(path))
    zarr.open_array(str(path / "reward/advantage"), mode="r+")[0, 0] = np.inf
    assert "reward/advantage is not finite at valid steps" in validate_store(path)


def test_garbage_is_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x.txt").write_text("hi")
    assert "not a zarr v3 store" in validate_store(tmp_path / "plain")[0]
    (tmp_path / "file.zarr").write_text("nope")
    assert "not a directory" in validate_store(tmp_path / "file.zarr")[0]
    (tmp_path / "broken.zarr").mkdir()
    (tmp_path / "broken.zarr" / "zarr.json").write_text("{not json")
    assert validate_store(tmp_path / "broken.zarr")
    empty = zarr.open_group(str(tmp_path / "empty.zarr"), mode="w")
    empty.attrs["complete"] = True
    problems = validate_store(tmp_path / "empty.zarr")
    assert "contract array step/chain is missing" in problems
    console, _ = _console()
    for p in ("plain", "file.zarr", "broken.zarr", "empty.zarr"):
        assert inspect_store(tmp_path / p, console) == 1


def test_task_table_formats(tmp_path: Path) -> None:
    from wamrl.inspect import task_names

    (tmp_path / "a.json").write_text(json.dumps([{"index": 3, "name": "x"}]))
    (tmp_path / "b.json").write_text(json.dumps({"tasks": [{"index": 0, "name": "y"}]}))
    assert task_names((tmp_path / "a.json",)) == {3: "x"}
    assert task_names((tmp_path / "missing.json", tmp_path / "b.json")) == {0: "y"}
    assert task_names((tmp_path / "missing.json",)) == {}


def test_compression_and_speed(tmp_path: Path) -> None:
    """Image-like data must compress; prints the ratio and write speed (pytest -s)."""
    rng = np.random.default_rng(0)
    E, n = 2, 16
    eps = [make_episode(rng, n, success=False, group=0) for _ in range(E)]
    for ep in eps:
        ep.done[-1] = True
    t0 = time.perf_counter()
    with ShardWriter(tmp_path / "s.zarr", E, n, K, TV, store_attrs()) as w:
        for i, ep in enumerate(eps):
            w.write_episode(i, ep)
    dt = time.perf_counter() - t0
    sizes = store_sizes(tmp_path / "s.zarr")
    files, disk, raw = sizes["step/image"]
    assert files == E * math.ceil(n / IMAGE_T_CHUNK)
    assert raw == E * n * 224 * 448 * 3  # n is a multiple of the chunk: raw = the data itself
    fd, fdisk, fraw = sizes["step/frames"]
    pixels = sum(ep.image.nbytes + ep.frames.nbytes for ep in eps)
    assert raw + fraw == pixels
    ratio = (raw + fraw) / (disk + fdisk)
    print(
        f"\nimage-like pixels: {pixels / 1e6:.0f} MB, ratio {ratio:.2f}x, whole shard written at {pixels / dt / 1e6:.0f} MB/s"
    )
    assert ratio > 1.5
