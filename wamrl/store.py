"""The episode store: one zarr v3 group per rollout shard (docs/design.md "Artifacts").

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

import json
import queue
import shutil
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from wamrl import faults
from wamrl.atomic import atomic_dir, make_temp_dir, replace_dir, settle
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

# The contract, one row per array (docs/design.md "Artifacts" + env_crashed + video/ + reward/).
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

    Per-step arrays have `length` rows (one per macro-step); the store pads to T. A writer
    with a background thread reads the arrays after write_episode returns: once handed
    over, they must not be modified.
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

    max_queued > 0 writes in a background thread instead, in submission order:
    write_episode only queues the episode (blocking while max_queued wait, so memory stays
    bounded), so a rollout loop goes on answering its envs' queries while chunks are
    compressed and written (the compression releases the GIL). The thread's first error is
    raised by the next write_episode, or else by close(), with a note naming the episode;
    the store is then removed as for any exception.
    """

    def __init__(
        self,
        path: str | Path,
        n_episodes: int,
        max_steps_T: int,
        K: int,
        max_video_steps: int,
        attrs: dict[str, Any],
        max_queued: int = 0,
    ):
        if n_episodes < 1 or max_steps_T < 1 or K < 2 or max_video_steps < 1:
            raise ValueError(
                f"need E >= 1, T >= 1, K >= 2, Tv >= 1; got {n_episodes, max_steps_T, K, max_video_steps}"
            )
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
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
        # The background writer (max_queued > 0): (index, episode) items, None = no more.
        self._queue: queue.Queue[tuple[int, EpisodeData] | None] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # the thread's first error
        self._dropping = threading.Event()  # abort(): the thread discards what is queued
        if max_queued:
            self._queue = queue.Queue(maxsize=max_queued)
            # daemon: a caller that never closes the writer must not hang the interpreter's exit
            self._thread = threading.Thread(
                target=self._drain, name=f"ShardWriter {self.path.name}", daemon=True
            )
            self._thread.start()

    def write_episode(self, i: int, ep: EpisodeData) -> None:
        """Write episode i, or with a background writer queue it (see the class docstring:
        ep's arrays must not change afterwards). Raises the background writer's first error."""
        E = self.dims[0]
        if self._closed:
            raise StoreError(f"{self.path}: writer already closed")
        if not 0 <= i < E:
            raise IndexError(f"episode {i} not in 0..{E - 1}")
        if self._queue is None:
            self._write(i, ep)
            return
        self._raise_thread_error()  # stop the caller at its next episode, not at the end
        self._queue.put((i, ep))  # blocks while max_queued episodes wait

    def _drain(self) -> None:
        """The background writer: write queued episodes in order until None. After an error
        (or an abort) it only discards items, so a caller blocked in put() never hangs."""
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            if self._error is not None or self._dropping.is_set():
                continue
            i, ep = item
            try:
                self._write(i, ep)
            except BaseException as e:  # everything reaches the caller, nothing dies here
                e.add_note(f"{self.path}: writing episode {i} (background writer thread)")
                self._error = e

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _join(self) -> None:
        """Wait until the background writer has written (or discarded) all it was given."""
        if self._thread is None:
            return
        assert self._queue is not None
        self._queue.put(None)
        self._thread.join()
        self._thread = None

    def _write(self, i: int, ep: EpisodeData) -> None:
        """Check and write one episode (in the caller or in the background writer thread)."""
        _, T, K, Tv = self.dims
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
            self._join()
            self._raise_thread_error()
            missing = sorted(set(range(E)) - self._written)
            if missing:
                raise StoreError(f"{self.path}: episodes {missing} were never written")
            from wamrl.store_check import validate_group  # it imports this module's schema

            problems = validate_group(self.tmp, self.root, deep=False)
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
        # The thread must be done before the temp goes: a write after rmtree would recreate
        # part of it. Queued episodes are dropped; one being written is finished (~0.1 s).
        self._dropping.set()
        self._join()
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
    path: str | Path,
    arrays: dict[str, np.ndarray],
    group_kept: np.ndarray,
    attrs: dict[str, Any],
    rollout: zarr.Group | None = None,
) -> None:
    """Write (or overwrite) `reward/` in a complete store.

    Built as `.reward.tmp-*` inside the store, then swapped in by renaming directories
    (atomic.replace_dir), so a rerun replaces the old group whole; a crash at any step leaves
    a state that the next call (or the reward stage's start) settles to the old group or the
    new one.
    Padding steps are stored as 0. attrs must hold beta, gamma, rec_mean, rec_std,
    world_model; groups_kept / groups_total are added from group_kept and episode/group.
    rollout: the store's group from open_rollout(path), whose opening validated the
    rollout's part; without it that part is validated here. Afterwards only the new reward/
    is checked: the rollout's part is read, never written, on the way.
    """
    from wamrl.store_check import validate_store  # it imports this module's schema

    path = Path(path)
    final_dir = path / "reward"
    if path.is_dir():
        # A killed earlier run may have left .reward.tmp-* or moved the old group aside
        # (.reward.old-*): settle restores a complete reward/ and deletes the rest.
        settle(final_dir)
        shutil.rmtree(path / "reward.tmp", ignore_errors=True)  # its name before .reward.tmp-*
    if rollout is None:
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
    with atomic_dir(final_dir, 0o755) as tmp_dir:
        _fill_reward_group(tmp_dir, clean, group_kept, group_attrs, (E, T, K, 1))
    problems = validate_store(path, include_rollout=False)
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


def open_store(
    path: str | Path, mode: str = "r", deep: bool = False, include_reward: bool = True
) -> zarr.Group:
    """Open a complete, valid store; raise StoreError naming the path and every problem.

    deep=False checks structure, attrs, masks and chunk-file integrity (blosc headers);
    deep=True also decompresses every chunk. include_reward=False checks the rollout's part
    only (open_rollout).
    """
    from wamrl.store_check import validate_store  # store_check imports this module's schema

    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    problems = validate_store(path, deep=deep, include_reward=include_reward)
    if problems:
        raise StoreError(f"{path}: not a usable episode store:\n- " + "\n- ".join(problems))
    return zarr.open_group(str(path), mode=mode, zarr_format=3)


def open_rollout(path: str | Path) -> zarr.Group:
    """Open a store read-only after checking the rollout's part only: reward/ is what the
    reward stage (re)writes, and the world-model stage reads the rollout while it does."""
    return open_store(path, include_reward=False)


def _as_root(store: str | Path | zarr.Group) -> zarr.Group:
    """A path is opened (and validated); an already opened group is trusted as is."""
    return store if isinstance(store, zarr.Group) else open_store(store)


def has_reward(root: zarr.Group) -> bool:
    """Whether the reward stage has written this store's reward/ group."""
    return "reward" in _member_names(root)


def read_episode_table(store: str | Path | zarr.Group) -> dict[str, np.ndarray]:
    """The small per-episode arrays (episode/* plus video_length, and group_kept once the
    reward stage ran) of a valid store: a path, or a group from open_store."""
    root = _as_root(store)
    table = read_episode_arrays(root, EPISODE_NAMES)
    table["video_length"] = read_video_length(root)
    if has_reward(root):
        table["group_kept"] = read_array(root, "reward/group_kept", root.store)
    return table


def read_episode_arrays(root: zarr.Group, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Some episode/* arrays by bare name ("task", "success", ...), and nothing else: for a
    reader that must not touch reward/ (open_rollout leaves it unchecked)."""
    return {name: read_array(root, f"episode/{name}", root.store) for name in names}


def step_shape(root: zarr.Group) -> tuple[int, int]:
    """(E, T): episodes, and macro-steps per episode row (read from metadata alone)."""
    E, T = root["step/valid"].shape
    return int(E), int(T)


def step_path(name: str) -> str:
    """The array path of a per-step array: "image" -> "step/image", "advantage" ->
    "reward/advantage"; a full path ("step/chain") is checked and returned as is."""
    paths = [name] if "/" in name else [f"step/{name}", f"reward/{name}"]
    for p in paths:
        spec = SPECS.get(p)
        if spec is not None and spec.dims[:2] == _STEP:
            return p
    raise KeyError(f"{name} is not an [episode, step, ...] contract array")


def read_step_table(store: str | Path | zarr.Group, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Whole [E, T] per-step arrays by name ("valid", "r_task", "advantage", ...): for the
    small ones; read the big ones (image, chain, frames) an episode at a time instead
    (read_episode_steps)."""
    root = _as_root(store)
    return {n: read_array(root, step_path(n), root.store) for n in names}


def read_episode_steps(
    root: zarr.Group, name: str, episode: int, steps: slice | int = slice(None)
) -> np.ndarray:
    """Macro-steps `steps` (a slice, or one step) of one episode of a per-step array (name
    as in step_path)."""
    return read_array(root, step_path(name), root.store, (int(episode), steps))


def read_video(root: zarr.Group, episode: int, frames: slice | int) -> np.ndarray:
    """video/frames of one episode: uint8 [n, H, W, 3] for a slice, [H, W, 3] for an index."""
    return read_array(root, "video/frames", root.store, (int(episode), frames))


def read_video_length(root: zarr.Group) -> np.ndarray:
    """video/length [E]: recorded video frames per episode (0 unless video-SFT)."""
    return read_array(root, "video/length", root.store)


def read_video_proprio(root: zarr.Group, episode: int, frame: int) -> np.ndarray | None:
    """The raw (not normalised) proprio recorded with one video frame, float32 [8]; None for
    a store written before video/proprio was recorded."""
    if "video/proprio" not in root:
        return None
    return read_array(root, "video/proprio", root.store, (int(episode), int(frame)))


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

    names: "step/chain", "reward/advantage", ... or bare names as in step_path.
    Returns (arrays, episode_idx, step_idx): arrays[name][n] belongs to episode
    episode_idx[n], macro-step step_idx[n]. Only the valid steps unless only_valid=False.
    Reads episode by episode, so only the requested arrays and steps are ever in memory;
    pass `episodes` to load a subset (e.g. images for one minibatch's episodes). Pass the
    group from open_store() to skip re-validating the store on every call.
    """
    root = _as_root(store)
    paths = [step_path(n) for n in names]
    for p in paths:
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
                buf[pos : pos + n] = read_episode_steps(root, p, e, slice(0, n))
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
