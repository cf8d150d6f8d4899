"""Expert demonstrations: recording, the demo store, and statistics from it (issue #6).

A demo store `demos/shard_WWW.zarr` (zarr v3) holds successful scripted-expert episodes in
the rollout store's conventions: model images (uint8 [224, 448, 3], [agentview | wrist]),
raw proprio as `raw_proprio` defines it, actions in the data convention (OSC deltas, gripper
1 = open, 0 = closed). Raw, not normalised: the statistics are computed from these stores.

    episode/{task, init_state, length}   int32 [E]          length = env steps taken
    env/state                            float32 [E, S, 8]  proprio before env step t
    env/action                           float32 [E, S, 7]  action executed at env step t
    step/image                           uint8 [E, Tq, ...] query images, env steps 0, 10, 20, ...
    video/frames                         uint8 [E, Tv, ...] video frames, env steps 0, 4, 8, ...

Fast-WAM's 10-of-32 chunking: a query at env step t = 10q sees step/image[q] and
env/state[t], and its target is the chunk env/action[t : t + 32], held still (zero motion,
last gripper) past the episode's end. Video windows are frames 4 env steps apart.
Rows past an episode's length are zero; only rendered frames are stored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from wamrl.atomic import atomic_dir
from wamrl.contract import ACTION_DIM, CHUNK_LEN, FRAME_STRIDE, IMAGE_HW, PROPRIO_DIM
from wamrl.envs.conventions import stats_entry
from wamrl.store import (
    _FLOAT_CODEC,
    _IMAGE_CODEC,
    _SMALL_CODEC,
    StoreError,
    checksummed,
    read_array,
)

QUERY_EVERY = 10  # env steps between queries (the replan interval)
H, W = IMAGE_HW
DEMO_SCHEMA_VERSION = 1


@dataclass
class Demo:
    """One recorded expert episode (length L env steps)."""

    task: int
    init_state: int
    state: np.ndarray  # float32 [L, 8]
    action: np.ndarray  # float32 [L, 7], data convention
    images: np.ndarray  # uint8 [ceil(L / 10), 224, 448, 3] at env steps 0, 10, ...
    frames: np.ndarray  # uint8 [L // 4 + 1, 224, 448, 3] at env steps 0, 4, ... (<= L)

    @property
    def length(self) -> int:
        return len(self.action)


def n_queries(length: int) -> int:
    return math.ceil(length / QUERY_EVERY)


def n_frames(length: int) -> int:
    return length // FRAME_STRIDE + 1


def rendered_steps(length: int) -> set[int]:
    """Env steps (observation index t = state before step t) whose image is stored."""
    return set(range(0, length, QUERY_EVERY)) | set(range(0, length + 1, FRAME_STRIDE))


def record(
    env: Any,
    expert: Any,
    init_state: int,
    max_steps: int,
    action_noise: float = 0.0,
    rng: np.random.Generator | None = None,
) -> tuple[Demo | None, int]:
    """Run the expert from `init_state`; the Demo if LIBERO reports success, else None.

    action_noise > 0 is DART-style noise injection: the env executes the expert's action plus
    N(0, action_noise^2) on the six arm dims (clipped to [-1, 1]), while the demo records the
    expert's own action. The expert is a feedback controller, so the demos then show how it
    corrects the small deviations a cloned policy makes, not only the one perfect path.

    Observation t (before env step t) is rendered only when it is stored: step t - 1 renders
    it (reset renders observation 0). Returns (demo or None, env steps taken)."""
    from wamrl.envs.conventions import gripper_from_env

    env.reset(init_state)
    expert.reset(env)
    states, actions, images, frames = [], [], [], []
    success = False
    t = 0
    while t < max_steps and not expert.done:
        if t % QUERY_EVERY == 0:
            images.append(env.render())
        if t % FRAME_STRIDE == 0:
            frames.append(env.render())
        states.append(env.proprio())
        a = np.asarray(expert.act(env), np.float64)
        executed = a
        if action_noise > 0:
            assert rng is not None, "action noise needs an rng"
            executed = a.copy()
            executed[:6] = np.clip(a[:6] + rng.normal(0.0, action_noise, 6), -1.0, 1.0)
        nxt = t + 1
        success = env.step(executed, render=nxt % QUERY_EVERY == 0 or nxt % FRAME_STRIDE == 0)
        data_action = a.astype(np.float32)
        data_action[-1] = gripper_from_env(np.sign(a[-1]) if a[-1] != 0 else -1.0)
        actions.append(data_action)
        t = nxt
        if success:
            break
    if not success:
        return None, t
    if t % FRAME_STRIDE == 0:
        frames.append(env.render())  # the final observation closes the last video window
    demo = Demo(
        task=env.task.index,
        init_state=init_state,
        state=np.stack(states).astype(np.float32),
        action=np.stack(actions),
        images=np.stack(images),
        frames=np.stack(frames),
    )
    assert len(demo.images) == n_queries(t) and len(demo.frames) == n_frames(t)
    return demo, t


def action_chunk(action: np.ndarray, t: int) -> np.ndarray:
    """The 32 actions from env step t, held still (zero deltas, last gripper) past the end."""
    chunk = np.zeros((CHUNK_LEN, action.shape[1]), np.float32)
    n = min(CHUNK_LEN, len(action) - t)
    chunk[:n] = action[t : t + n]
    chunk[n:, -1] = action[-1, -1]
    return chunk


# ----------------------------------------------------------------------------- the store


def _array(group: zarr.Group, path: str, shape: tuple[int, ...], dtype: str, dims, codec):
    chunks = (1, *shape[1:]) if len(shape) <= 3 else (1, 4, *shape[2:])
    return group.create_array(
        path,
        shape=shape,
        dtype=dtype,
        chunks=chunks,
        compressors=checksummed(codec),  # each chunk carries a crc32c, as rollout stores
        fill_value=0,
        dimension_names=dims,
        config={"write_empty_chunks": True},
    )


def write_demo_store(path: Path, demos: list[Demo], attrs: dict[str, Any]) -> None:
    """Write `demos` to a hidden temp store, mark it complete and rename it to `path`."""
    if not demos:
        raise ValueError(f"{path}: no successful demonstrations to write")
    path = Path(path)
    E = len(demos)
    S = max(d.length for d in demos)
    with atomic_dir(path, 0o755) as tmp:
        root = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        root.attrs.update(
            json.loads(
                json.dumps(
                    {
                        **attrs,
                        "schema_version": DEMO_SCHEMA_VERSION,
                        "query_every": QUERY_EVERY,
                        "chunk": CHUNK_LEN,
                        "video_stride": FRAME_STRIDE,
                    }
                )
            )
        )
        ep = ("episode",)
        a = {
            name: _array(root, f"episode/{name}", (E,), "int32", ep, _SMALL_CODEC)
            for name in ("task", "init_state", "length")
        }
        state = _array(
            root, "env/state", (E, S, PROPRIO_DIM), "float32", (*ep, "step", "d"), _FLOAT_CODEC
        )
        act = _array(
            root, "env/action", (E, S, ACTION_DIM), "float32", (*ep, "step", "d"), _FLOAT_CODEC
        )
        px = ("height", "width", "channel")
        img = _array(
            root, "step/image", (E, n_queries(S), H, W, 3), "uint8", (*ep, "query", *px),
            _IMAGE_CODEC,
        )  # fmt: skip
        frm = _array(
            root, "video/frames", (E, n_frames(S), H, W, 3), "uint8", (*ep, "frame", *px),
            _IMAGE_CODEC,
        )  # fmt: skip
        for i, d in enumerate(demos):
            a["task"][i], a["init_state"][i], a["length"][i] = d.task, d.init_state, d.length
            row = np.zeros((S, PROPRIO_DIM), np.float32)
            row[: d.length] = d.state
            state[i] = row
            row = np.zeros((S, ACTION_DIM), np.float32)
            row[: d.length] = d.action
            act[i] = row
            img[i, : len(d.images)] = d.images
            frm[i, : len(d.frames)] = d.frames
        root.attrs["complete"] = True


@dataclass
class DemoSet:
    """Every demo of some stores, in memory (uint8 pixels), ready for SFT sampling."""

    task: np.ndarray  # int32 [E]
    length: np.ndarray  # int32 [E]
    state: list[np.ndarray]  # per episode float32 [L, 8]
    action: list[np.ndarray]  # per episode float32 [L, 7]
    images: list[np.ndarray]  # per episode uint8 [Tq, 224, 448, 3]
    frames: list[np.ndarray]  # per episode uint8 [Tv, 224, 448, 3]

    def __len__(self) -> int:
        return len(self.task)


def open_demo_store(path: Path) -> zarr.Group:
    path = Path(path)
    if not (path / "zarr.json").is_file():
        raise StoreError(f"{path}: not a zarr store (no zarr.json)")
    root = zarr.open_group(str(path), mode="r")
    if root.attrs.get("complete") is not True:
        raise StoreError(f"{path}: incomplete demo store (attribute `complete` is not true)")
    if root.attrs.get("schema_version") != DEMO_SCHEMA_VERSION:
        raise StoreError(f"{path}: demo schema {root.attrs.get('schema_version')}, expected 1")
    return root


def load_demos(paths: list[Path]) -> DemoSet:
    tasks, lengths, states, actions, images, frames = [], [], [], [], [], []
    for p in paths:
        root = open_demo_store(p)

        def read(name: str, sel: Any = slice(None), root: zarr.Group = root, p: Path = p):
            return read_array(root, name, p, sel)  # an unreadable chunk names store and array

        ln = read("episode/length")
        tasks.append(read("episode/task"))
        lengths.append(ln)
        st, ac = read("env/state"), read("env/action")
        for i, L in enumerate(ln):
            states.append(st[i, :L])
            actions.append(ac[i, :L])
            images.append(read("step/image", (i, slice(0, n_queries(L)))))
            frames.append(read("video/frames", (i, slice(0, n_frames(L)))))
    if not tasks:
        raise ValueError("no demo stores given")
    return DemoSet(np.concatenate(tasks), np.concatenate(lengths), states, actions, images, frames)


def demo_stats(demos: DemoSet) -> dict[str, Any]:
    """Normalisation statistics in Fast-WAM's format over every env step of the demos."""
    state = np.concatenate(demos.state).astype(np.float64)
    action = np.concatenate(demos.action).astype(np.float64)
    return {
        "source": f"scripted-expert demonstrations: {len(demos)} episodes, {len(state)} steps",
        "state": {"libero_proprio": stats_entry(state)},
        "action": {"libero_osc_pose": stats_entry(action)},
    }
