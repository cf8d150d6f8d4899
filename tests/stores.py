"""Synthetic episode stores (no LIBERO): episodes with image-like renders, written with
store.ShardWriter, and reward groups. Used by test_store and the tests that corrupt, swap or
plan from such stores (tests/faults runs some of them in a subprocess)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zarr

from wamrl.store import REWARD_NAMES, EpisodeData, ShardWriter

# The stores' dims: K sampler steps, room for T macro-steps and TV video frames.
K, T, TV = 4, 6, 13
LENGTHS = (6, 3, 1)  # make_episodes' episodes


def store_attrs() -> dict:
    return {
        "iteration": 1,
        "shard": 0,
        "K": K,
        "G": 2,
        "a": 0.5,
        "policy_checkpoint": "iter_000/policy",
        "policy_sha256": "ab" * 32,
        "config": {"sampler": {"K": K, "noise_a": 0.5}},
    }


def image_like(rng: np.random.Generator, n: int, shift0: int = 0) -> np.ndarray:
    """Flat-shaded scene (wall, table with a tiled texture), moving objects, a little
    render noise: compresses roughly like a LIBERO render, unlike white noise."""
    tile = rng.integers(0, 24, size=(16, 16, 3))
    out = np.empty((n, 224, 448, 3), np.uint8)
    for t in range(n):
        s = shift0 + 3 * t
        img = np.empty((224, 448, 3), np.int64)
        img[:90] = (180, 185, 190)  # wall
        img[90:] = np.tile(tile, (9, 28, 1))[: 224 - 90] + (120, 90, 60)  # wooden table
        img[100:140, 40 + s % 150 : 80 + s % 150] = (200, 30, 30)  # a moving block
        img[:, 224:] = img[:, :224][::-1] // 2 + 40  # the wrist view half
        img[90:] += rng.integers(-2, 3, size=(224 - 90, 448, 3))  # shading noise on the table
        out[t] = np.clip(img, 0, 255).astype(np.uint8)
    return out


def make_episode(
    rng: np.random.Generator,
    length: int,
    success: bool,
    group: int = 0,
    video: int = 0,
    crashed: bool = False,
) -> EpisodeData:
    r_task = np.zeros(length, np.float32)
    done = np.zeros(length, bool)
    if length:
        done[-1] = True
        if success:
            r_task[-1] = 1.0
    return EpisodeData(
        task=3 + group,
        init_state=7 * group,
        group=group,
        success=success,
        video_sft=video > 0,
        env_crashed=crashed,
        length=length,
        image=image_like(rng, length),
        proprio=rng.standard_normal((length, 8)).astype(np.float32),
        chain=rng.standard_normal((length, K + 1, 32, 7)).astype(np.float32),
        k_star=rng.integers(1, K, size=length).astype(np.int32),
        logp_old=rng.standard_normal(length).astype(np.float32) * 10,
        frames=np.stack([image_like(rng, length, 12), image_like(rng, length, 24)], axis=1),
        r_task=r_task,
        done=done,
        video_frames=image_like(rng, video) if video else None,
        video_proprio=rng.standard_normal((video, 8)).astype(np.float32) if video else None,
    )


def make_episodes(seed: int = 0) -> list[EpisodeData]:
    rng = np.random.default_rng(seed)
    return [
        make_episode(rng, LENGTHS[0], success=True, group=0),
        make_episode(rng, LENGTHS[1], success=False, group=0, video=7),
        make_episode(rng, LENGTHS[2], success=False, group=1, crashed=True),
    ]


def write_store(path: Path, episodes: list[EpisodeData], max_queued: int = 0) -> Path:
    """max_queued > 0: through ShardWriter's background writer thread."""
    with ShardWriter(path, len(episodes), T, K, TV, store_attrs(), max_queued) as w:
        for i, ep in enumerate(episodes):
            w.write_episode(i, ep)
    return path


def chunk_file(path: Path, array: str, coords: tuple[int, ...]) -> Path:
    """The file that holds one chunk of `array` (to delete, truncate or flip)."""
    arr = zarr.open_array(str(path / array), mode="r")
    return path / array / arr.metadata.encode_chunk_key(coords)


def reward_arrays(E: int, seed: int) -> dict[str, np.ndarray]:
    """Random values for every reward array of E episodes x T steps."""
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((E, T)).astype(np.float32) for n in REWARD_NAMES}


REWARD_ATTRS = {
    "beta": 0.1,
    "gamma": 0.99,
    "rec_mean": -0.02,
    "rec_std": 0.01,
    "world_model": "live",
}
