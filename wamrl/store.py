"""The episode store: one zarr v3 group per rollout shard (DESIGN.md "Artifacts").

Layout (E episodes, T macro-steps, K denoising steps, Tv recorded video frames):

    episode/{task, init_state, group, length, success, video_sft, env_crashed}   [E]
    step/{valid, image, proprio, chain, k_star, logp_old, frames, r_task, done}  [E, T, ...]
    video/{frames, proprio, length}                                              [E, Tv, ...]
    reward/{r_rec, r_rec_norm, reward, return, advantage} [E, T], reward/group_kept [E]
                                                           (added later by the reward stage)

Every array is chunked per episode, so the rollout writes an episode as soon as it ends
(memory stays bounded) and a reader pulls one episode without touching the others. Arrays
are created with `write_empty_chunks=True`: each written region has its chunk files even
when they hold only zeros, so a deleted chunk file is detectable (zarr would otherwise read
it back silently as fill value).

A store is complete only when its root attribute `complete` is true: the writer builds it
at a hidden sibling path, validates it, sets `complete` last and renames it into place.

Every array ends its codec pipeline with zarr v3's `crc32c` codec: each chunk file carries
a checksum of its compressed bytes, so a flipped byte fails validation (every chunk file is
checked, without decompressing) and any read. Stores written before that carry none and
are reported as unchecked, not as invalid (`checksum_coverage`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from wamrl import faults
from wamrl.atomic import leftovers, make_temp_dir, replace_dir, settle
from wamrl.contract import ACTION_DIM, CHUNK_LEN, IMAGE_HW, N_FUTURE, PROPRIO_DIM

# Snakemake drops a `.snakemake_timestamp` file into every directory output (a store here);
# it is not part of the hierarchy and zarr's warning about it would only be noise.
warnings.filterwarnings("ignore", message=r"Object at \.snakemake_timestamp", category=UserWarning)

SCHEMA_VERSION = 1
H, W = IMAGE_HW
IMAGE_T_CHUNK = 4  # image chunk (1, 4, 224, 448, 3) = 1.2 MB raw; frames chunk 2.4 MB
VIDEO_T_CHUNK = 8  # video chunk (1, 8, 224, 448, 3) = 2.4 MB raw

# zstd inside blosc (blosc's header gives a cheap truncation check, see _chunk_file_problem).
# Measured on rendered LIBERO model images (4-frame chunks, 2 tasks): with blosc's default
# blocks (~256 KB) zstd-3 reaches 2.3x; one block per chunk lets zstd's window span
# neighbouring frames: 3.7x at ~185 MB/s write, ~1 GB/s read on one core (zstd-5: 3.85x at
# half the write speed). uint8 has typesize 1, so shuffle would be a no-op. Float arrays
# (chains are mostly Gaussian noise) gain ~10% from byte shuffle.
_IMAGE_CODEC = BloscCodec(cname="zstd", clevel=3, shuffle="noshuffle", blocksize=1 << 22)
_FLOAT_CODEC = BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")
_SMALL_CODEC = BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")
_ARRAY_CONFIG = {"write_empty_chunks": True}

REQUIRED_ATTRS = (
    "iteration",
    "shard",
    "K",
    "G",
    "a",
    "policy_checkpoint",
    "policy_sha256",
    "config",
)
REWARD_ATTRS = ("beta", "gamma", "rec_mean", "rec_std", "world_model")
REWARD_NAMES = ("r_rec", "r_rec_norm", "reward", "return", "advantage")


class StoreError(RuntimeError):
    """A store that is missing, half-written or does not match the contract."""


Dims = tuple[int, int, int, int]  # (E, T, K, Tv)


@dataclass(frozen=True)
class ArraySpec:
    """One contract array. `extent` says which part of an episode's row the writer stores:
    "all" = the whole row (so every chunk exists), "steps" = the first episode/length steps,
    "video" = the first video/length frames."""

    path: str
    dtype: str
    dims: tuple[str, ...]
    shape: Callable[[int, int, int, int], tuple[int, ...]]  # (E, T, K, Tv) -> shape
    chunks: Callable[[int, int, int, int], tuple[int, ...]]
    extent: str = "all"
    codec: BloscCodec = field(default=_SMALL_CODEC)

    @property
    def compressors(self) -> tuple[BloscCodec, Crc32cCodec]:
        """The bytes codecs: compression, then a crc32c of the compressed chunk (last)."""
        return checksummed(self.codec)

    @property
    def group(self) -> str:
        return self.path.split("/")[0]

    @property
    def name(self) -> str:
        return self.path.split("/")[1]


def checksummed(codec: BloscCodec) -> tuple[BloscCodec, Crc32cCodec]:
    """`compressors=` for an array whose chunks carry a crc32c (every store writer's)."""
    return (codec, Crc32cCodec())


def has_checksum(arr: zarr.Array) -> bool:
    codecs = arr.metadata.codecs if arr.metadata.zarr_format == 3 else ()
    return bool(codecs) and isinstance(codecs[-1], Crc32cCodec)


def _ep(E: int, T: int, K: int, Tv: int) -> tuple[int, ...]:
    return (E,)


def _ep_chunk(E: int, T: int, K: int, Tv: int) -> tuple[int, ...]:
    return (1,)


def _et(E: int, T: int, K: int, Tv: int) -> tuple[int, ...]:
    return (E, T)


def _et_chunk(E: int, T: int, K: int, Tv: int) -> tuple[int, ...]:
    return (1, T)


_EPISODE = ("episode",)
_STEP = ("episode", "step")
_PIXELS = ("height", "width", "channel")

# The contract, one row per array (DESIGN.md "Artifacts" + env_crashed + video/ + reward/).
SCHEMA: tuple[ArraySpec, ...] = (
    ArraySpec("episode/task", "int32", _EPISODE, _ep, _ep_chunk),
    ArraySpec("episode/init_state", "int32", _EPISODE, _ep, _ep_chunk),
    ArraySpec("episode/group", "int32", _EPISODE, _ep, _ep_chunk),
    ArraySpec("episode/length", "int32", _EPISODE, _ep, _ep_chunk),
    ArraySpec("episode/success", "bool", _EPISODE, _ep, _ep_chunk),
    ArraySpec("episode/video_sft", "bool", _EPISODE, _ep, _ep_chunk),
    ArraySpec("episode/env_crashed", "bool", _EPISODE, _ep, _ep_chunk),
    ArraySpec("step/valid", "bool", _STEP, _et, _et_chunk),
    ArraySpec(
        "step/image",
        "uint8",
        (*_STEP, *_PIXELS),
        lambda E, T, K, Tv: (E, T, H, W, 3),
        lambda E, T, K, Tv: (1, min(IMAGE_T_CHUNK, T), H, W, 3),
        extent="steps",
        codec=_IMAGE_CODEC,
    ),
    ArraySpec(
        "step/proprio",
        "float32",
        (*_STEP, "proprio"),
        lambda E, T, K, Tv: (E, T, PROPRIO_DIM),
        lambda E, T, K, Tv: (1, T, PROPRIO_DIM),
        codec=_FLOAT_CODEC,
    ),
    ArraySpec(
        "step/chain",
        "float32",
        (*_STEP, "k", "chunk", "action"),
        lambda E, T, K, Tv: (E, T, K + 1, CHUNK_LEN, ACTION_DIM),
        lambda E, T, K, Tv: (1, T, K + 1, CHUNK_LEN, ACTION_DIM),
        codec=_FLOAT_CODEC,
    ),
    ArraySpec("step/k_star", "int32", _STEP, _et, _et_chunk),
    ArraySpec("step/logp_old", "float32", _STEP, _et, _et_chunk, codec=_FLOAT_CODEC),
    ArraySpec(
        "step/frames",
        "uint8",
        (*_STEP, "future", *_PIXELS),
        lambda E, T, K, Tv: (E, T, N_FUTURE, H, W, 3),
        lambda E, T, K, Tv: (1, min(IMAGE_T_CHUNK, T), N_FUTURE, H, W, 3),
        extent="steps",
        codec=_IMAGE_CODEC,
    ),
    ArraySpec("step/r_task", "float32", _STEP, _et, _et_chunk),
    ArraySpec("step/done", "bool", _STEP, _et, _et_chunk),
    ArraySpec(
        "video/frames",
        "uint8",
        ("episode", "video_step", *_PIXELS),
        lambda E, T, K, Tv: (E, Tv, H, W, 3),
        lambda E, T, K, Tv: (1, min(VIDEO_T_CHUNK, Tv), H, W, 3),
        extent="video",
        codec=_IMAGE_CODEC,
    ),
    ArraySpec(
        "video/proprio",
        "float32",
        ("episode", "video_step", "proprio"),
        lambda E, T, K, Tv: (E, Tv, PROPRIO_DIM),
        lambda E, T, K, Tv: (1, Tv, PROPRIO_DIM),
        extent="video",
        codec=_FLOAT_CODEC,
    ),
    ArraySpec("video/length", "int32", _EPISODE, _ep, _ep_chunk),
    *(
        ArraySpec(f"reward/{n}", "float32", _STEP, _et, _et_chunk, codec=_FLOAT_CODEC)
        for n in REWARD_NAMES
    ),
    ArraySpec("reward/group_kept", "bool", _EPISODE, _ep, _ep_chunk),
)
SPECS: dict[str, ArraySpec] = {s.path: s for s in SCHEMA}
CORE_GROUPS = ("episode", "step", "video")  # written by the rollout; `reward` comes later
EPISODE_NAMES = ("task", "init_state", "group", "length", "success", "video_sft", "env_crashed")


# --------------------------------------------------------------------------- writing


@dataclass
class EpisodeData:
    """One finished episode, as the rollout hands it to ShardWriter.write_episode.

    Per-step arrays have `length` rows (one per macro-step); the store pads to T.
    """

    task: int
    init_state: int
    group: int
    success: bool
    video_sft: bool
    env_crashed: bool
    length: int
    image: np.ndarray  # uint8 [t, 224, 448, 3]
    proprio: np.ndarray  # float32 [t, 8]
    chain: np.ndarray  # float32 [t, K+1, 32, 7]
    k_star: np.ndarray  # int32 [t]
    logp_old: np.ndarray  # float32 [t]
    frames: np.ndarray  # uint8 [t, 2, 224, 448, 3]
    r_task: np.ndarray  # float32 [t]
    done: np.ndarray  # bool [t]
    video_frames: np.ndarray | None = None  # uint8 [n, 224, 448, 3], video-SFT episodes only
    video_proprio: np.ndarray | None = None  # float32 [n, 8]


def _create_array(group: zarr.Group, spec: ArraySpec, dims: Dims) -> zarr.Array:
    return group.create_array(
        spec.path,
        shape=spec.shape(*dims),
        dtype=spec.dtype,
        chunks=spec.chunks(*dims),
        compressors=spec.compressors,
        fill_value=np.zeros((), dtype=spec.dtype).item(),
        dimension_names=spec.dims,
        config=_ARRAY_CONFIG,
    )


def _checked(name: str, x: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    x = np.asarray(x)
    if x.shape != shape:
        raise ValueError(f"EpisodeData.{name}: expected shape {shape}, got {x.shape}")
    if dtype == "uint8" and x.dtype != np.uint8:
        raise ValueError(f"EpisodeData.{name}: expected uint8 pixels, got {x.dtype}")
    return x.astype(dtype, copy=False)


class ShardWriter:
    """Write one shard episode by episode into a hidden temporary store; close() publishes it.

    with ShardWriter(path, E, T, K, Tv, attrs) as w:
        for i, ep in enumerate(episodes):
            w.write_episode(i, ep)
    # on normal exit: validated, `complete` set, renamed to `path`; on exception: removed
    """

    def __init__(
        self,
        path: str | Path,
        n_episodes: int,
        max_steps_T: int,
        K: int,
        max_video_steps: int,
        attrs: dict[str, Any],
    ):
        if n_episodes < 1 or max_steps_T < 1 or K < 2 or max_video_steps < 1:
            raise ValueError(
                f"need E >= 1, T >= 1, K >= 2, Tv >= 1; got {n_episodes, max_steps_T, K, max_video_steps}"
            )
        missing = [k for k in REQUIRED_ATTRS if k not in attrs and k != "K"]
        if missing:
            raise ValueError(f"ShardWriter attrs lack {missing} (contract: {list(REQUIRED_ATTRS)})")
        if "K" in attrs and int(attrs["K"]) != K:
            raise ValueError(f"attrs K={attrs['K']} disagrees with K={K}")
        self.path = Path(path)
        self.dims: Dims = (n_episodes, max_steps_T, K, max_video_steps)
        # Settles what a killed writer of this shard left (its temp, a moved-aside old store).
        self.tmp = make_temp_dir(self.path, 0o755)
        self._written: set[int] = set()
        self._closed = False
        try:
            self.root = zarr.open_group(str(self.tmp), mode="w", zarr_format=3)
            # `complete` is absent until close(): a reader of the temp sees a half-written store.
            root_attrs = {**_jsonable(attrs), "K": K, "schema_version": SCHEMA_VERSION}
            self.root.attrs.update(root_attrs)
            self.arrays = {
                s.path: _create_array(self.root, s, self.dims)
                for s in SCHEMA
                if s.group in CORE_GROUPS
            }
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def write_episode(self, i: int, ep: EpisodeData) -> None:
        E, T, K, Tv = self.dims
        if self._closed:
            raise StoreError(f"{self.path}: writer already closed")
        if not 0 <= i < E:
            raise IndexError(f"episode {i} not in 0..{E - 1}")
        t = int(ep.length)
        if not 0 <= t <= T:
            raise ValueError(f"episode {i}: length {t} not in 0..{T}")
        steps = {
            "image": ("uint8", (t, H, W, 3)),
            "proprio": ("float32", (t, PROPRIO_DIM)),
            "chain": ("float32", (t, K + 1, CHUNK_LEN, ACTION_DIM)),
            "k_star": ("int32", (t,)),
            "logp_old": ("float32", (t,)),
            "frames": ("uint8", (t, N_FUTURE, H, W, 3)),
            "r_task": ("float32", (t,)),
            "done": ("bool", (t,)),
        }
        data = {n: _checked(n, getattr(ep, n), dt, shp) for n, (dt, shp) in steps.items()}
        n_video = 0 if ep.video_frames is None else len(ep.video_frames)
        if n_video > Tv:
            raise ValueError(f"episode {i}: {n_video} video frames > max_video_steps {Tv}")
        if n_video and not ep.video_sft:
            raise ValueError(f"episode {i}: video frames given but video_sft is False")

        a = self.arrays
        # Small per-step arrays: write the whole padded row so every chunk exists.
        valid = np.zeros(T, bool)
        valid[:t] = True
        a["step/valid"][i] = valid
        for name in ("proprio", "chain", "k_star", "logp_old", "r_task", "done"):
            row = np.zeros(a[f"step/{name}"].shape[1:], dtype=a[f"step/{name}"].dtype)
            row[:t] = data[name]
            a[f"step/{name}"][i] = row
        if t:  # big arrays: only the valid steps (padding chunks stay unwritten)
            a["step/image"][i, :t] = data["image"]
            a["step/frames"][i, :t] = data["frames"]
        if n_video:
            a["video/frames"][i, :n_video] = _checked(
                "video_frames", ep.video_frames, "uint8", (n_video, H, W, 3)
            )
            vp = (
                ep.video_proprio
                if ep.video_proprio is not None
                else np.zeros((n_video, PROPRIO_DIM))
            )
            a["video/proprio"][i, :n_video] = _checked(
                "video_proprio", vp, "float32", (n_video, PROPRIO_DIM)
            )
        a["video/length"][i] = n_video
        for name in EPISODE_NAMES:
            value = t if name == "length" else getattr(ep, name)
            a[f"episode/{name}"][i] = value
        self._written.add(i)
        faults.point("episode")

    def close(self) -> None:
        """Validate, mark complete and atomically rename into place. Raises StoreError on problems."""
        if self._closed:
            return
        E = self.dims[0]
        try:
            missing = sorted(set(range(E)) - self._written)
            if missing:
                raise StoreError(f"{self.path}: episodes {missing} were never written")
            problems = _validate_group(self.tmp, self.root, deep=False)
            if problems:
                raise StoreError(
                    f"{self.path}: refusing to publish an invalid store:\n- "
                    + "\n- ".join(problems)
                )
            self.root.attrs["complete"] = True  # last write before the rename
            faults.point("filled")
            replace_dir(self.tmp, self.path)
            self._closed = True
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        self._closed = True
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _jsonable(obj: Any) -> Any:
    """Attrs go to JSON: turn numpy scalars/arrays and Paths into plain values."""
    return json.loads(json.dumps(obj, default=_json_default))


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"attribute value {o!r} is not JSON-serialisable")


# --------------------------------------------------------------------------- reward group


def write_reward_group(
    path: str | Path, arrays: dict[str, np.ndarray], group_kept: np.ndarray, attrs: dict[str, Any]
) -> None:
    """Write (or overwrite) `reward/` in a complete store.

    Built as `.reward.tmp-*` inside the store, then swapped in by renaming directories
    (atomic.replace_dir), so a rerun replaces the old group whole; a crash at any step leaves
    a state that the next call (or the reward stage's start) settles to the old group or the
    new one.
    Padding steps are stored as 0. attrs must hold beta, gamma, rec_mean, rec_std,
    world_model; groups_kept / groups_total are added from group_kept and episode/group.
    """
    path = Path(path)
    final_dir = path / "reward"
    if path.is_dir():
        # A killed earlier run may have left .reward.tmp-* or moved the old group aside
        # (.reward.old-*): settle restores a complete reward/ and deletes the rest.
        settle(final_dir)
        shutil.rmtree(path / "reward.tmp", ignore_errors=True)  # its name before .reward.tmp-*
    # Check only the rollout's part: a broken old reward/ group is what a rerun replaces.
    problems = validate_store(path, include_reward=False)
    if problems:
        raise StoreError(f"{path}: not a usable episode store:\n- " + "\n- ".join(problems))
    root = zarr.open_group(str(path), mode="r+", zarr_format=3)
    E, T = root["step/valid"].shape
    K = int(root.attrs["K"])
    missing = sorted(set(REWARD_NAMES) - set(arrays))
    extra = sorted(set(arrays) - set(REWARD_NAMES))
    if missing or extra:
        raise ValueError(f"reward arrays: missing {missing}, unexpected {extra}")
    lacking = [k for k in REWARD_ATTRS if k not in attrs]
    if lacking:
        raise ValueError(f"reward attrs lack {lacking}")
    valid = root["step/valid"][:]
    group_kept = np.asarray(group_kept, dtype=bool)
    if group_kept.shape != (E,):
        raise ValueError(f"group_kept: expected shape {(E,)}, got {group_kept.shape}")
    clean: dict[str, np.ndarray] = {}
    for name in REWARD_NAMES:
        x = np.asarray(arrays[name], dtype=np.float32)
        if x.shape != (E, T):
            raise ValueError(f"reward/{name}: expected shape {(E, T)}, got {x.shape}")
        if not np.isfinite(x[valid]).all():
            raise ValueError(f"reward/{name}: non-finite values at valid steps")
        clean[name] = np.where(valid, x, np.float32(0))

    groups = root["episode/group"][:]
    kept_groups = sorted({int(g) for g, k in zip(groups, group_kept, strict=True) if k})
    group_attrs = {
        **_jsonable(attrs),
        "groups_kept": len(kept_groups),
        "groups_total": len(set(groups.tolist())),
        "complete": True,
    }
    # Built as a hidden sibling group in the store (a group's zarr.json holds no path, so a
    # rename moves it), then published by replace_dir: crash-safe at every step.
    tmp_dir = make_temp_dir(final_dir, 0o755)
    try:
        _fill_reward_group(tmp_dir, clean, group_kept, group_attrs, (E, T, K, 1))
        faults.point("filled")
        replace_dir(tmp_dir, final_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    problems = validate_store(path)
    if problems:
        raise StoreError(f"{path}: invalid after writing reward/:\n- " + "\n- ".join(problems))
    faults.point("reward_group")


def _fill_reward_group(
    tmp_dir: Path,
    clean: dict[str, np.ndarray],
    group_kept: np.ndarray,
    group_attrs: dict[str, Any],
    dims: Dims,
) -> None:
    E = dims[0]
    tmp_group = zarr.open_group(str(tmp_dir), mode="w", zarr_format=3, attributes=group_attrs)
    for name in REWARD_NAMES:
        spec = SPECS[f"reward/{name}"]
        arr = tmp_group.create_array(
            name,
            shape=spec.shape(*dims),
            dtype=spec.dtype,
            chunks=spec.chunks(*dims),
            compressors=spec.compressors,
            fill_value=0.0,
            dimension_names=spec.dims,
            config=_ARRAY_CONFIG,
        )
        arr[:] = clean[name]
    spec = SPECS["reward/group_kept"]
    arr = tmp_group.create_array(
        "group_kept",
        shape=(E,),
        dtype="bool",
        chunks=spec.chunks(*dims),
        compressors=spec.compressors,
        fill_value=False,
        dimension_names=spec.dims,
        config=_ARRAY_CONFIG,
    )
    arr[:] = group_kept


# --------------------------------------------------------------------------- reading


def check_made_under(
    paths: Sequence[str | Path], cfg: dict[str, Any], with_reward: bool = False
) -> None:
    """Refuse stores made under another config than `cfg` (config.MADE_UNDER: the rollout's
    keys from the root attrs, and with_reward the reward keys from reward/'s attrs), before
    any work. A store too broken to read its attrs is left to validation, which says why."""
    from wamrl.config import check_made_under as check

    for path in paths:
        try:
            root = zarr.open_group(str(path), mode="r", zarr_format=3)
            attrs = dict(root.attrs)
        except Exception:
            continue
        if attrs.get("complete") is not True:
            continue  # half-written: validation reports it
        check(cfg, attrs.get("config"), "rollout", Path(path))
        if with_reward:
            try:
                rattrs = dict(root["reward"].attrs)
            except Exception:
                continue
            check(cfg, rattrs.get("config"), "reward", Path(path) / "reward")


def open_store(path: str | Path, mode: str = "r", deep: bool = False) -> zarr.Group:
    """Open a complete, valid store; raise StoreError naming the path and every problem.

    deep=False checks structure, attrs, masks and chunk-file integrity (blosc headers);
    deep=True also decompresses every chunk.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    problems = validate_store(path, deep=deep)
    if problems:
        raise StoreError(f"{path}: not a usable episode store:\n- " + "\n- ".join(problems))
    return zarr.open_group(str(path), mode=mode, zarr_format=3)


def _as_root(store: str | Path | zarr.Group) -> zarr.Group:
    """A path is opened (and validated); an already opened group is trusted as is."""
    return store if isinstance(store, zarr.Group) else open_store(store)


def read_episode_table(store: str | Path | zarr.Group) -> dict[str, np.ndarray]:
    """The small per-episode arrays (episode/* plus video_length, and group_kept once the
    reward stage ran) of a valid store: a path, or a group from open_store."""
    root = _as_root(store)
    table = {name: root[f"episode/{name}"][:] for name in EPISODE_NAMES}
    table["video_length"] = root["video/length"][:]
    if "reward" in _member_names(root):
        table["group_kept"] = root["reward/group_kept"][:]
    return table


def read_plan_table(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(episode/task, episode/success, episode/env_crashed) of a complete store, without
    validating the whole store (the next iteration's plan needs only these): a missing,
    half-written or corrupt store raises StoreError naming it."""
    path = Path(path)
    if not path.is_dir():
        raise StoreError(f"{path}: no episode store there")
    try:
        root = zarr.open_group(str(path), mode="r", zarr_format=3)
    except Exception as e:
        raise StoreError(f"{path}: cannot open the episode store: {type(e).__name__}: {e}") from e
    if root.attrs.get("complete") is not True:
        raise StoreError(f"{path}: store is half-written (no `complete` attribute)")
    return tuple(  # type: ignore[return-value]
        read_array(root, f"episode/{n}", path) for n in ("task", "success", "env_crashed")
    )


def read_array(root: zarr.Group, name: str, path: str | Path, sel: Any = slice(None)) -> np.ndarray:
    """root[name][sel], a read error (missing chunk, checksum mismatch) as a StoreError
    naming the store and the array."""
    try:
        return np.asarray(root[name][sel])
    except Exception as e:
        raise StoreError(f"{path}: array {name}: unreadable: {type(e).__name__}: {e}") from e


def load_steps(
    store: str | Path | zarr.Group,
    names: Sequence[str],
    only_valid: bool = True,
    episodes: Sequence[int] | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Per-step arrays flattened over (episode, step) pairs.

    names: "step/chain", "reward/advantage", ... (a bare name means step/<name>).
    Returns (arrays, episode_idx, step_idx): arrays[name][n] belongs to episode
    episode_idx[n], macro-step step_idx[n]. Only the valid steps unless only_valid=False.
    Reads episode by episode, so only the requested arrays and steps are ever in memory;
    pass `episodes` to load a subset (e.g. images for one minibatch's episodes). Pass the
    group from open_store() to skip re-validating the store on every call.
    """
    root = _as_root(store)
    paths = [n if "/" in n else f"step/{n}" for n in names]
    for p in paths:
        spec = SPECS.get(p)
        if spec is None or spec.dims[:2] != _STEP:
            raise KeyError(f"{p} is not an [episode, step, ...] contract array")
        if p not in _array_paths(root):
            raise KeyError(
                f"{root.store}: has no array {p} (reward/ is written by the reward stage)"
            )
    E, T = root["step/valid"].shape
    ep_list = list(range(E)) if episodes is None else [int(e) for e in episodes]
    lengths = root["episode/length"][:]
    counts = [int(lengths[e]) if only_valid else T for e in ep_list]
    total = sum(counts)
    out: dict[str, np.ndarray] = {}
    for p in paths:
        arr = root[p]
        buf = np.empty((total, *arr.shape[2:]), dtype=arr.dtype)
        pos = 0
        for e, n in zip(ep_list, counts, strict=True):
            if n:
                buf[pos : pos + n] = read_array(root, p, root.store, (e, slice(0, n)))
            pos += n
        out[p] = buf
    ep_idx = np.repeat(np.asarray(ep_list, dtype=np.int64), counts)
    step_idx = (
        np.concatenate([np.arange(n, dtype=np.int64) for n in counts])
        if counts
        else np.zeros(0, np.int64)
    )
    return out, ep_idx, step_idx


def _member_names(group: zarr.Group) -> set[str]:
    return {name for name, _ in group.members()}


def _array_paths(root: zarr.Group) -> set[str]:
    """Every array in the store by path, at any depth (so stray nested arrays show up)."""
    return {name for name, m in root.members(max_depth=None) if isinstance(m, zarr.Array)}


# --------------------------------------------------------------------------- validation


def validate_store(path: str | Path, deep: bool = False, include_reward: bool = True) -> list[str]:
    """Every problem with the store at `path`, as sentences; [] means valid. Never raises
    on a broken store (garbage, half-written, deleted or truncated chunk files)."""
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
        return _validate_group(
            path, root, deep=deep, require_complete=True, include_reward=include_reward
        )
    except Exception as e:  # anything unforeseen in a corrupted store is reported, not raised
        return [f"{path}: validation stopped on an unreadable store: {type(e).__name__}: {e}"]


def _validate_group(
    path: Path,
    root: zarr.Group,
    deep: bool,
    require_complete: bool = False,
    include_reward: bool = True,
) -> list[str]:
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
        s.path for s in SCHEMA if s.group in CORE_GROUPS or (has_reward and s.group == "reward")
    }
    for p in sorted(expected - present):
        problems.append(f"contract array {p} is missing")
    for p in sorted(present - expected):
        what = (
            "leftover of an interrupted write_reward_group (the reward stage's next run settles it)"
            if p.startswith(("reward.tmp", ".reward."))
            else "not in the contract"
        )
        problems.append(f"unexpected array {p}: {what}")
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
    small = {}
    for p in sorted(expected):
        if SPECS[p].extent != "all" or p == "step/chain":
            continue
        try:
            small[p] = root[p][:]
        except Exception as e:
            problems += _chunk_problems(path, root, expected, None, None)
            return [*problems, f"{p}: cannot read: {type(e).__name__}: {e}"]

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
