"""Validation of episode stores against the contract in wamrl.store.

A store is checked without trusting it: structure and attrs, array metadata, the masks and
per-step invariants, the reward group, and every chunk file the writer must have stored
(present, not truncated, its crc32c matching). `validate_store` never raises on a broken
store; it returns every problem as a sentence. The chunk-file scans for `wamrl inspect`
(checksums, sizes) live here too: they read the same files the same way.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import BloscCodec

from wamrl.atomic import leftovers
from wamrl.store import (
    CORE_GROUPS,
    REQUIRED_ATTRS,
    REWARD_ATTRS,
    REWARD_NAMES,
    SCHEMA,
    SPECS,
    ArraySpec,
    Dims,
    _array_paths,
    has_checksum,
)


def validate_store(
    path: str | Path, deep: bool = False, include_reward: bool = True, include_rollout: bool = True
) -> list[str]:
    """Every problem with the store at `path`, as sentences; [] means valid. Never raises
    on a broken store (garbage, half-written, deleted or truncated chunk files).

    include_reward=False leaves out reward/ (which the reward stage rewrites);
    include_rollout=False checks reward/ alone, for a writer that validated the rollout's
    part just before and did not write it since."""
    path = Path(path)
    if not path.exists():
        tmps = [p.name for p in leftovers(path)]
        hint = (
            f" (a half-written {tmps[0]} lies next to it: its writer never finished; the "
            "writer's next run settles it)"
            if tmps
            else ""
        )
        return [f"{path} does not exist{hint}"]
    if not path.is_dir():
        return [f"{path} is not a directory (a zarr v3 store is one)"]
    if not (path / "zarr.json").is_file():
        return [f"{path} is not a zarr v3 store (no zarr.json at its root)"]
    try:
        root = zarr.open_group(str(path), mode="r", zarr_format=3)
    except Exception as e:  # a broken zarr.json, wrong format, ...
        return [f"{path} cannot be opened as a zarr v3 group: {type(e).__name__}: {e}"]
    try:
        return validate_group(
            path,
            root,
            deep=deep,
            require_complete=True,
            include_reward=include_reward,
            include_rollout=include_rollout,
        )
    except Exception as e:  # anything unforeseen in a corrupted store is reported, not raised
        return [f"{path}: validation stopped on an unreadable store: {type(e).__name__}: {e}"]


def validate_group(
    path: Path,
    root: zarr.Group,
    deep: bool,
    require_complete: bool = False,
    include_reward: bool = True,
    include_rollout: bool = True,
) -> list[str]:
    """validate_store on an open group (the writer's own, before it is published)."""
    problems: list[str] = []
    attrs = dict(root.attrs)
    if require_complete and attrs.get("complete") is not True:
        problems.append(
            "store is half-written: the root attribute `complete` is missing or not true "
            "(its writer never finished; rerun the rollout that makes it)"
        )
    problems += [f"root attribute `{k}` is missing" for k in REQUIRED_ATTRS if k not in attrs]

    try:
        present = _array_paths(root)
    except Exception as e:
        return [*problems, f"cannot list the store's arrays: {type(e).__name__}: {e}"]
    if not include_reward:
        # reward/ and the reward stage's work in progress beside it (.reward.tmp-*, while a
        # world-model job reads the same store at the same time)
        present = {p for p in present if not p.startswith(("reward", ".reward."))}
    has_reward = any(p.startswith("reward/") for p in present)
    expected = {
        s.path
        for s in SCHEMA
        if (include_rollout and s.group in CORE_GROUPS)
        or ((has_reward or not include_rollout) and s.group == "reward")
    }
    in_scope = (
        present if include_rollout else {p for p in present if p.startswith(("reward", ".reward."))}
    )
    for p in sorted(expected - present):
        problems.append(f"contract array {p} is missing")
    for p in sorted(in_scope - expected):
        what = (
            "leftover of an interrupted write_reward_group (the reward stage's next run settles it)"
            if p.startswith(("reward.tmp", ".reward."))
            else "not in the contract"
        )
        problems.append(f"unexpected array {p}: {what}")
    if not include_rollout and expected - present:
        return problems  # no reward/ to check
    if any(p not in present for p in ("episode/task", "step/valid", "step/chain", "video/frames")):
        return problems  # sizes cannot be derived

    E = root["episode/task"].shape[0]
    T = root["step/valid"].shape[1] if root["step/valid"].ndim == 2 else -1
    K = root["step/chain"].shape[2] - 1 if root["step/chain"].ndim == 5 else -1
    Tv = root["video/frames"].shape[1] if root["video/frames"].ndim == 5 else -1
    if "K" in attrs and attrs["K"] != K:
        problems.append(f"attrs K={attrs['K']} but step/chain holds K+1={K + 1} chain states")
    if K < 2:
        problems.append(f"K={K}: need K >= 2 so that 1 <= k* <= K-1 is possible")
    dims: Dims = (E, T, K, Tv)

    layout_ok = True
    for p in sorted(expected & present):
        bad = _check_array_meta(root[p], SPECS[p], dims)
        problems += bad
        layout_ok &= not bad
    if not layout_ok:
        return problems  # masks and chunks are meaningless under a wrong layout

    # Reading small arrays may hit a deleted/truncated chunk: report and stop there.
    # The reward checks compare against the rollout's valid mask and groups.
    small_paths = {p for p in expected if SPECS[p].extent == "all" and p != "step/chain"}
    if not include_rollout:
        small_paths |= {"step/valid", "episode/group"}
    small = {}
    for p in sorted(small_paths):
        try:
            small[p] = root[p][:]
        except Exception as e:
            problems += _chunk_problems(path, root, expected, None, None)
            return [*problems, f"{p}: cannot read: {type(e).__name__}: {e}"]

    if not include_rollout:  # reward/'s arrays span whole rows: no lengths needed
        problems += _chunk_problems(path, root, expected, None, None)
        return problems + _check_reward(root, small, attrs)
    length = small["episode/length"]
    video_length = small["video/length"]
    problems += _chunk_problems(path, root, expected, length, video_length)
    problems += _check_masks(small, attrs, T, K, Tv)
    if has_reward:
        problems += _check_reward(root, small, attrs)
    problems += _check_chain(root["step/chain"], E)
    if deep:
        problems += _deep_read(root, expected, length, video_length)
    return problems


def _check_array_meta(arr: zarr.Array, spec: ArraySpec, dims: Dims) -> list[str]:
    out = []
    dtype = str(arr.dtype)
    if dtype != spec.dtype:
        out.append(f"{spec.path} has dtype {dtype}, the contract says {spec.dtype}")
    want = spec.shape(*dims)
    if tuple(arr.shape) != want:
        out.append(
            f"{spec.path} has shape {tuple(arr.shape)}, expected {want} for (E, T, K, Tv) = {dims}"
        )
    names = arr.metadata.dimension_names if arr.metadata.zarr_format == 3 else None
    if names is None or tuple(names) != spec.dims:
        out.append(f"{spec.path} has dimension_names {names}, expected {spec.dims}")
    return out


def _check_masks(
    s: dict[str, np.ndarray], attrs: dict[str, Any], T: int, K: int, Tv: int
) -> list[str]:
    out: list[str] = []
    length, valid, done = s["episode/length"], s["step/valid"], s["step/done"]
    success, crashed, r_task = s["episode/success"], s["episode/env_crashed"], s["step/r_task"]
    k_star, logp = s["step/k_star"], s["step/logp_old"]
    steps = np.arange(T)
    for i in np.flatnonzero((length < 0) | (length > T)):
        out.append(f"episode {i}: length {length[i]} outside 0..{T}")
    prefix = steps[None, :] < np.clip(length, 0, T)[:, None]
    for i in np.flatnonzero((valid != prefix).any(1)):
        out.append(
            f"episode {i}: step/valid is not a prefix of length episode/length = {length[i]}"
        )
    for i in np.flatnonzero((length == 0) & ~crashed):
        out.append(f"episode {i}: zero macro-steps but env_crashed is False")
    last = prefix & (steps[None, :] == (length - 1)[:, None])
    for i in np.flatnonzero((done != last).any(1)):
        out.append(
            f"episode {i}: step/done must be True exactly at its last valid step {length[i] - 1}"
        )
    for i in np.flatnonzero(success & crashed):
        out.append(
            f"episode {i}: success and env_crashed are both True (a crashed episode counts as failed)"
        )
    for i in np.flatnonzero(((r_task != 0) & ~prefix).any(1)):
        out.append(f"episode {i}: step/r_task is nonzero at padding steps")
    for i in np.flatnonzero(((r_task != 0) & (r_task != 1)).any(1)):
        out.append(f"episode {i}: step/r_task holds values other than 0 and 1")
    ones = (r_task == 1).sum(1)
    for i in np.flatnonzero(ones > 1):
        out.append(
            f"episode {i}: step/r_task is 1 at {ones[i]} steps (at most one: where success first holds)"
        )
    for i in np.flatnonzero((ones > 0) & ~success):
        out.append(f"episode {i}: step/r_task has a 1 but episode/success is False")
    for i in np.flatnonzero(success & ~(last & (r_task == 1)).any(1)):
        out.append(
            f"episode {i}: success but step/r_task is not 1 at its last valid step (the episode ends on success)"
        )
    bad_k = prefix & ((k_star < 1) | (k_star > K - 1))
    for i in np.flatnonzero(bad_k.any(1)):
        out.append(f"episode {i}: step/k_star outside 1..{K - 1} at valid steps")
    for i in np.flatnonzero((prefix & ~np.isfinite(logp)).any(1)):
        out.append(f"episode {i}: step/logp_old is not finite at valid steps")
    for name, x in (("k_star", k_star), ("logp_old", logp), ("done", done)):
        for i in np.flatnonzero((~prefix & (x != 0)).any(1)):
            out.append(f"episode {i}: step/{name} is nonzero at padding steps")
    vl, sft = s["video/length"], s["episode/video_sft"]
    for i in np.flatnonzero((vl < 0) | (vl > Tv)):
        out.append(f"episode {i}: video/length {vl[i]} outside 0..{Tv}")
    for i in np.flatnonzero((vl > 0) & ~sft):
        out.append(f"episode {i}: video frames recorded but episode/video_sft is False")
    # Members of a group share (task, init state); a shard may hold only part of a group.
    groups, task, init = s["episode/group"], s["episode/task"], s["episode/init_state"]
    G = attrs.get("G")
    for g in np.unique(groups):
        m = groups == g
        if len(set(zip(task[m].tolist(), init[m].tolist(), strict=True))) > 1:
            out.append(f"group {g}: members differ in task or init_state")
        if isinstance(G, int) and m.sum() > G:
            out.append(f"group {g}: {m.sum()} episodes but G = {G}")
    return out


def _check_reward(root: zarr.Group, s: dict[str, np.ndarray], attrs: dict[str, Any]) -> list[str]:
    out = []
    rattrs = dict(root["reward"].attrs)
    out += [f"reward group attribute `{k}` is missing" for k in REWARD_ATTRS if k not in rattrs]
    valid = s["step/valid"]
    for name in REWARD_NAMES:
        x = s[f"reward/{name}"]
        if not np.isfinite(x[valid]).all():
            out.append(f"reward/{name} is not finite at valid steps")
    kept, groups = s["reward/group_kept"], s["episode/group"]
    for g in np.unique(groups):
        if len(set(kept[groups == g].tolist())) > 1:
            out.append(f"reward/group_kept differs within group {g}")
    return out


def _check_chain(chain: zarr.Array, E: int) -> list[str]:
    out = []
    for i in range(E):  # one episode at a time: the whole chain can be hundreds of MB
        try:
            if not np.isfinite(chain[i]).all():
                out.append(f"episode {i}: step/chain holds non-finite values")
        except Exception as e:
            out.append(f"episode {i}: step/chain unreadable: {type(e).__name__}: {e}")
    return out


def _expected_chunks(
    spec: ArraySpec, arr: zarr.Array, length: np.ndarray | None, video_length: np.ndarray | None
) -> Iterator[tuple[int, ...]]:
    """Chunk coordinates the writer must have stored for this array."""
    grid = [math.ceil(s / c) for s, c in zip(arr.shape, arr.chunks, strict=True)]
    rest = [range(n) for n in grid[2:]]
    for i in range(grid[0]):
        if spec.extent == "all" or len(grid) == 1:
            n_step = grid[1] if len(grid) > 1 else None
        else:
            lens = length if spec.extent == "steps" else video_length
            if lens is None:
                continue
            n_step = min(math.ceil(max(int(lens[i]), 0) / arr.chunks[1]), grid[1])
        if n_step is None:
            yield (i,)
            continue
        for j in range(n_step):
            yield from ((i, j, *r) for r in itertools.product(*rest))


def _chunk_problems(
    path: Path,
    root: zarr.Group,
    expected: set[str],
    length: np.ndarray | None,
    video_length: np.ndarray | None,
) -> list[str]:
    """Missing chunk files, blosc chunks whose header disagrees with the file size, and
    chunks whose crc32c does not match their bytes (every chunk file is read, not
    decompressed: a few GB/s)."""
    out = []
    for p in sorted(expected):
        arr, spec = root[p], SPECS[p]
        blosc = any(isinstance(c, BloscCodec) for c in arr.metadata.codecs)
        crc = has_checksum(arr)
        missing, truncated, corrupt = [], [], []
        for coords in _expected_chunks(spec, arr, length, video_length):
            f = path / p / arr.metadata.encode_chunk_key(coords)
            try:
                size = f.stat().st_size
            except FileNotFoundError:
                missing.append(coords)
                continue
            problem = _chunk_file_problem(f, size, blosc, crc)
            if problem == "truncated":
                truncated.append(coords)
            elif problem == "checksum":
                corrupt.append(coords)
        if missing:
            out.append(
                f"{p}: {len(missing)} chunk file(s) missing, first at chunk {missing[0]} (deleted or never written)"
            )
        if truncated:
            out.append(
                f"{p}: {len(truncated)} chunk file(s) truncated or corrupt, first at chunk {truncated[0]}"
            )
        if corrupt:
            out.append(
                f"{p}: {len(corrupt)} chunk file(s) fail their crc32c checksum, first at chunk "
                f"{corrupt[0]} (bytes changed on disk)"
            )
    return out


def _chunk_file_problem(f: Path, size: int, blosc: bool, crc: bool) -> str | None:
    """None, "truncated" or "checksum". A blosc1 frame starts with a 16-byte header whose
    bytes 12..16 are its compressed size (the file size, less the 4 crc32c bytes that end
    a checksummed chunk): a cheap truncation check without decompressing image chunks."""
    if not (blosc or crc):
        return None
    with open(f, "rb") as fh:
        data = fh.read() if crc else fh.read(16)
    payload = size - 4 if crc else size
    if blosc and (payload < 16 or int.from_bytes(data[12:16], "little") != payload):
        return "truncated"
    if crc and (
        len(data) < 4 or google_crc32c.value(data[:-4]) != int.from_bytes(data[-4:], "little")
    ):
        return "checksum"
    return None


def _deep_read(
    root: zarr.Group, expected: set[str], length: np.ndarray, video_length: np.ndarray
) -> list[str]:
    """Decompress every stored chunk of the big arrays (one episode at a time)."""
    out = []
    for p in sorted(expected):
        spec, arr = SPECS[p], root[p]
        if spec.extent == "all":
            continue  # already read in full
        lens = length if spec.extent == "steps" else video_length
        for i in range(arr.shape[0]):
            n = int(lens[i])
            if n <= 0:
                continue
            try:
                arr[i, :n]
            except Exception as e:
                out.append(f"{p}: episode {i} unreadable: {type(e).__name__}: {e}")
    return out


# --------------------------------------------------------------------------- sizes (inspect)


def checksum_problems(path: str | Path) -> list[str]:
    """Every chunk file on disk of every checksummed array, checked against its crc32c: for
    any zarr v3 store (demo stores too), without knowing which chunks it should hold."""
    path = Path(path)
    try:
        root = zarr.open_group(str(path), mode="r", zarr_format=3)
        arrays = sorted(_array_paths(root))
    except Exception as e:
        return [f"{path}: cannot open as a zarr v3 group: {type(e).__name__}: {e}"]
    out = []
    for p in arrays:
        arr = root[p]
        if not has_checksum(arr):
            continue
        blosc = any(isinstance(c, BloscCodec) for c in arr.metadata.codecs)
        bad = []
        for dirpath, _, files in os.walk(path / p / "c"):
            for name in sorted(files):
                f = Path(dirpath) / name
                if _chunk_file_problem(f, f.stat().st_size, blosc, crc=True):
                    bad.append(str(f.relative_to(path / p)))
        if bad:
            out.append(
                f"{p}: {len(bad)} chunk file(s) truncated or failing their crc32c, first {bad[0]}"
            )
    return out


def checksum_coverage(path: str | Path) -> tuple[list[str], list[str]]:
    """(arrays whose chunks carry a crc32c, arrays without one: written before checksums)."""
    root = zarr.open_group(str(path), mode="r", zarr_format=3)
    arrays = sorted(_array_paths(root))
    checked = [p for p in arrays if has_checksum(root[p])]
    return checked, [p for p in arrays if p not in checked]


def store_sizes(path: str | Path) -> dict[str, tuple[int, int, int]]:
    """Per array: (chunk files, bytes on disk, uncompressed bytes of those chunks).

    Uncompressed bytes count each stored chunk clipped to the array's bounds (zarr pads
    edge chunks to full size on disk; the padding is not data)."""
    path = Path(path)
    root = zarr.open_group(str(path), mode="r", zarr_format=3)
    out = {}
    for p in sorted(_array_paths(root)):
        arr = root[p]
        n, disk, raw = 0, 0, 0
        cdir = path / p / "c"
        for dirpath, _, files in os.walk(cdir):
            rel = Path(dirpath).relative_to(cdir).parts
            for fname in files:
                try:
                    coords = [int(c) for c in (*rel, fname)]
                    size = os.stat(os.path.join(dirpath, fname)).st_size
                except (OSError, ValueError):
                    continue  # not a chunk file of the default encoding
                extent = [
                    max(0, min(c, s - i * c))
                    for i, c, s in zip(coords, arr.chunks, arr.shape, strict=False)
                ]
                n += 1
                disk += size
                raw += int(np.prod(extent)) * arr.dtype.itemsize
        out[p] = (n, disk, raw)
    return out
