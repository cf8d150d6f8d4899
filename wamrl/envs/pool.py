"""A pool of LIBERO env worker processes with a non-blocking protocol.

One LiberoEnv per process (spawned, MUJOCO_GL set in the child before robosuite is
imported), kept alive across episodes and rebuilt only when the task changes. The rollout
loop drives all slots at once:

    pool.start_episode(slot, task, init_state, record_video, max_macro_steps)
    for ev in pool.poll(timeout):           # Query / StepResult / Crashed
        Query      -> the slot waits for a chunk: batch all waiting slots into one policy call,
                      then pool.send_chunk(slot, env_actions(...))   # float64 [10, 7]
        StepResult -> the chunk ran; if not done, a Query for the same slot follows
        Crashed    -> the episode is lost; the next start_episode restarts that process

Per chunk the worker renders the model image at +4 and +8 env steps (the two "frames"
the reward compares with the world model's imagination), every step if record_video,
and the next query image at the last step (not after the episode's last chunk).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from wamrl import timing
from wamrl.contract import FRAME_OFFSETS
from wamrl.envs.conventions import Normalizer
from wamrl.envs.tasks import Task


@dataclass
class Query:
    slot: int
    image: np.ndarray  # uint8 [224, 448, 3], the model image at the query
    proprio_raw: np.ndarray  # float32 [8], not normalised


@dataclass
class StepResult:
    """The outcome of one chunk (one macro-step).

    video / video_proprio (record_video episodes only) hold the state after each executed
    env step of this chunk (n = steps executed, 10 unless the episode stopped early). The
    episode's full video is the first Query's image followed by every StepResult's video.
    """

    slot: int
    frames: np.ndarray  # uint8 [2, 224, 448, 3] at +4 and +8
    success: bool  # LIBERO success reached during this chunk
    done: bool  # episode over (success, step budget or macro-step cap)
    video: np.ndarray | None  # uint8 [n, 224, 448, 3]
    video_proprio: np.ndarray | None  # float32 [n, 8]
    env_steps: int = 0  # policy env steps executed in this chunk


@dataclass
class Crashed:
    slot: int
    error: str


Event = Query | StepResult | Crashed


# ----------------------------------------------------------------------------- worker side


class _Episode:
    def __init__(
        self, task: Task, record_video: bool, max_macro_steps: int | None, record_frames: bool
    ):
        self.task = task
        self.record_video = record_video
        self.record_frames = record_frames  # eval needs no +4/+8 frames: 1 render per chunk
        self.max_macro_steps = max_macro_steps
        self.macro_steps = 0
        self.last_image: np.ndarray | None = None  # the last model image rendered


def _run_chunk(env: Any, ep: _Episode, actions: np.ndarray) -> tuple[dict[str, Any], bool]:
    """Execute one chunk; returns the StepResult fields and whether the episode is done."""
    # Known before the chunk: whether it is the last one (macro-step cap or step budget); then
    # its last step needs no render for a next query.
    final = (
        ep.max_macro_steps is not None and ep.macro_steps + 1 >= ep.max_macro_steps
    ) or env.steps_taken + len(actions) >= ep.task.max_steps
    frames: list[np.ndarray] = []
    video: list[np.ndarray] = []
    video_proprio: list[np.ndarray] = []
    success = False
    executed = 0
    for action in actions:
        if env.steps_taken >= ep.task.max_steps:
            break
        n = executed + 1
        frame = ep.record_frames and n in FRAME_OFFSETS
        render = ep.record_video or frame or (n == len(actions) and not final)
        success = env.step(action, render=render)
        executed = n
        if render:
            ep.last_image = env.render()
        if ep.record_video:
            video.append(ep.last_image)
            video_proprio.append(env.proprio())
        if frame:
            frames.append(ep.last_image)
        if success:
            break
    ep.macro_steps += 1
    # Stopped early (success): the frames not reached repeat the last rendered frame (the
    # +4 frame, or this chunk's query image if success came before +4). Renders are
    # decided before a step runs, so there is no image of the exact stopping state.
    frames += [ep.last_image] * (len(FRAME_OFFSETS) - len(frames))
    done = (
        success
        or env.steps_taken >= ep.task.max_steps
        or (ep.max_macro_steps is not None and ep.macro_steps >= ep.max_macro_steps)
    )
    result = {
        "frames": np.stack(frames),
        "success": bool(success),
        "done": bool(done),
        "video": np.stack(video) if ep.record_video and video else None,
        "video_proprio": np.stack(video_proprio) if ep.record_video and video else None,
        "env_steps": executed,
    }
    return result, done


def _worker_main(
    conn: Connection, cfg_env: dict[str, Any], seed: int, parent_pid: int | None = None
) -> None:
    if parent_pid is not None:  # first: a kill -9 of the stage takes this env down with it
        from wamrl.lifetime import die_with_parent

        die_with_parent(parent_pid)
    # The policy process answers every env's query, so its latency is every env's latency:
    # env workers (CPU-bound, often more of them than cores) run at a lower priority.
    os.nice(5)
    timing.mark("worker_start")  # WAMRL_TIMING: phases of this env process (wamrl/timing.py)
    os.environ["MUJOCO_GL"] = str(cfg_env.get("mujoco_gl", "egl"))
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
    from wamrl.envs.libero_env import LiberoEnv  # imports robosuite: after MUJOCO_GL

    timing.mark("imported")

    env: LiberoEnv | None = None
    ep: _Episode | None = None
    try:
        while True:
            with timing.phase("wait"):  # for the parent: a query's answer, the next episode
                msg = conn.recv()
            kind = msg[0]
            if kind == "close":
                timing.relabel_last("wait", "tail_idle")
                break
            if kind == "start":
                _, task, init_state, record_video, max_macro_steps, record_frames = msg
                if env is None or env.task.index != task.index:
                    if env is not None:
                        env.close()
                    env = LiberoEnv(
                        task,
                        render_size=int(cfg_env.get("render_size", 256)),
                        settle_steps=int(cfg_env.get("settle_steps", 30)),
                        seed=seed,
                        msaa=bool(cfg_env.get("msaa", False)),
                        model_cache=cfg_env.get("model_cache"),
                    )
                ep = _Episode(task, record_video, max_macro_steps, record_frames)
                env.reset(init_state)  # renders the last settle step
                # Checked after the reset: before it, steps_left still counts the last
                # episode's steps (a reused env after a full 700-step libero_10 episode).
                if ep.task.max_steps > env.steps_left:
                    raise RuntimeError(
                        f"{task.name}: budget {ep.task.max_steps} exceeds the {env.steps_left} "
                        "env steps left after the reset"
                    )
                ep.last_image = env.render()
                conn.send(("query", ep.last_image, env.proprio()))
            elif kind == "chunk":
                if ep is None or env is None:
                    raise RuntimeError("chunk sent with no episode running")
                result, done = _run_chunk(env, ep, msg[1])
                conn.send(("step", result))
                if done:
                    ep = None
                else:  # the chunk's last step was rendered: ep.last_image is the current state
                    conn.send(("query", ep.last_image, env.proprio()))
            else:
                raise ValueError(f"unknown command {kind!r}")
    except (EOFError, KeyboardInterrupt):
        pass  # the parent went away
    except BaseException:  # report anything else to the parent, then exit
        with contextlib.suppress(OSError):
            conn.send(("crashed", traceback.format_exc()))
    finally:
        if env is not None:
            with contextlib.suppress(Exception):  # GL teardown errors at exit are harmless
                env.close()
        timing.write("env")


# ----------------------------------------------------------------------------- parent side


@dataclass
class _Slot:
    process: mp.process.BaseProcess | None = None
    conn: Connection | None = None
    busy: bool = False  # an episode is in flight


class EnvPool:
    """n env worker processes; see the module docstring for the protocol."""

    def __init__(self, n: int, stats_path: str | Path, cfg_env: dict[str, Any], seed: int = 0):
        self.normalizer = Normalizer.load(stats_path)  # validated here, used by the caller
        self.cfg_env = dict(cfg_env)
        self.replan = int(self.cfg_env.get("replan_steps", 10))
        self.seed = seed
        self._ctx = mp.get_context("spawn")
        self._slots = [_Slot() for _ in range(n)]
        self._pending: list[Event] = []
        for slot in range(n):
            self._spawn(slot)

    def __len__(self) -> int:
        return len(self._slots)

    def _spawn(self, slot: int) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child, self.cfg_env, self.seed + slot, os.getpid()),
            name=f"libero-env-{slot}",
            daemon=True,
        )
        proc.start()
        child.close()  # so the parent sees EOF when the child dies
        self._slots[slot] = _Slot(proc, parent, False)

    def _alive(self, slot: int) -> bool:
        s = self._slots[slot]
        return s.process is not None and s.process.is_alive()

    def _mark_crashed(self, slot: int, error: str) -> None:
        s = self._slots[slot]
        was_busy = s.busy
        if s.conn is not None:
            s.conn.close()
        if s.process is not None:
            s.process.join(timeout=5)
            if s.process.is_alive():
                s.process.kill()
                s.process.join(timeout=5)
        self._slots[slot] = _Slot()
        if was_busy:
            self._pending.append(Crashed(slot, error))

    def pids(self) -> list[int | None]:
        return [s.process.pid if s.process is not None else None for s in self._slots]

    def start_episode(
        self,
        slot: int,
        task: Task,
        init_state: int,
        record_video: bool = False,
        max_macro_steps: int | None = None,
        record_frames: bool = True,
    ) -> None:
        """Begin an episode; a Query for `slot` follows. max_macro_steps None = the task's budget.

        record_frames False (eval): the +4/+8 frames are not rendered; StepResult.frames then
        repeats the chunk's query image, so only the image for the next query is rendered.
        """
        s = self._slots[slot]
        if s.busy:
            raise RuntimeError(f"slot {slot} already runs an episode")
        if not self._alive(slot):
            if s.process is not None:
                self._mark_crashed(slot, "died while idle")
            self._spawn(slot)
        msg = ("start", task, int(init_state), bool(record_video), max_macro_steps, record_frames)
        self._send(slot, msg)

    def send_chunk(self, slot: int, actions: np.ndarray) -> None:
        """Execute `replan` env actions (float64 [replan, 7], already in env units)."""
        actions = np.asarray(actions, dtype=np.float64)
        if actions.shape != (self.replan, 7):
            raise ValueError(f"expected [{self.replan}, 7] env actions, got {actions.shape}")
        if not self._slots[slot].busy:
            raise RuntimeError(f"slot {slot} has no episode running")
        self._send(slot, ("chunk", actions))

    def _send(self, slot: int, msg: tuple) -> None:
        s = self._slots[slot]
        s.busy = True
        try:
            s.conn.send(msg)
        except (OSError, ValueError) as e:  # broken pipe: the worker is gone
            self._mark_crashed(slot, f"worker unreachable: {e!r}")

    def poll(self, timeout: float | None = None) -> list[Event]:
        """Events that arrived within `timeout` seconds (returns as soon as any is there)."""
        events, self._pending = self._pending, []
        if events:
            timeout = 0.0
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            waitables: dict[Any, int] = {}
            for i, s in enumerate(self._slots):
                if s.busy and s.conn is not None:
                    waitables[s.conn] = i
                    waitables[s.process.sentinel] = i
            if not waitables:
                return events
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(waitables), timeout=left)
            for obj in ready:
                slot = waitables[obj]
                events += self._drain(slot)
            events += self._pending
            self._pending = []
            if events or not ready and left == 0.0:
                return events
            if deadline is not None and time.monotonic() >= deadline:
                return events

    def _drain(self, slot: int) -> list[Event]:
        """Read every message waiting on a slot's pipe; a dead worker becomes Crashed."""
        s = self._slots[slot]
        out: list[Event] = []
        if not s.busy or s.conn is None:
            return out
        try:
            while s.conn.poll():
                msg = s.conn.recv()
                if msg[0] == "query":
                    out.append(Query(slot, msg[1], msg[2]))
                elif msg[0] == "step":
                    res = StepResult(slot=slot, **msg[1])
                    if res.done:
                        s.busy = False
                    out.append(res)
                elif msg[0] == "crashed":
                    self._mark_crashed(slot, msg[1])
                    return out
        except (EOFError, OSError) as e:
            code = s.process.exitcode if s.process is not None else None
            self._mark_crashed(slot, f"worker died (exit code {code}): {e!r}")
            return out
        if s.busy and not self._alive(slot):
            code = s.process.exitcode if s.process is not None else None
            self._mark_crashed(slot, f"worker died (exit code {code})")
        return out

    def close(self) -> None:
        for s in self._slots:
            if s.conn is not None:
                with contextlib.suppress(OSError, ValueError):
                    s.conn.send(("close",))
        for s in self._slots:
            if s.process is not None:
                s.process.join(timeout=10)
                if s.process.is_alive():
                    s.process.terminate()
                    s.process.join(timeout=5)
            if s.conn is not None:
                s.conn.close()
        self._slots = [_Slot() for _ in self._slots]

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
