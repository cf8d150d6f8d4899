"""One LIBERO task environment, kept alive across episodes (docs/design.md "Environment conventions").

Rendering only the frames that are used: robosuite's camera observables would render both
cameras on every env step (70-360 ms on CPU). Turning them off (use_camera_obs=False) and
rendering after the step is NOT equivalent: robosuite samples its observables after the
FIRST of the 25 physics substeps of a step, so obs["agentview_image"] (what Fast-WAM's data
and eval use) shows the scene ~48 ms earlier than the end of the step. So we keep the
camera observables, with robosuite's own timing, and gate their sensor: it renders only on
steps asked for with `step(action, render=True)`, and returns a cached blank otherwise.
`render()` then returns exactly model_image(obs[agentview], obs[wrist]) of that step.

Set MUJOCO_GL (egl | osmesa) before constructing one: robosuite picks its GL backend at import.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from wamrl import timing
from wamrl.envs.conventions import DUMMY_ACTION, model_image, raw_proprio
from wamrl.envs.tasks import Task

CAMERAS = ("agentview", "robot0_eye_in_hand")
DEFAULT_HORIZON = 1000  # LIBERO's ControlEnv default; Fast-WAM's eval never reaches it


@contextlib.contextmanager
def _model_loading(offsamples: int | None, cache_dir: Path | None) -> Iterator[None]:
    """While a robosuite env is built, its MjModel comes from `compile_model`.

    Two costs of building an env go away (together ~60 % of it): MuJoCo's compile of the
    scene XML (meshes, convex hulls: 1-3 s per task), loaded instead from a binary .mjb of
    the same XML when cached; and a second GL context, since MSAA is set on the model before
    robosuite makes the context (MuJoCo reads vis.quality.offsamples only then).
    robosuite builds the sim in exactly one place, MjSim.from_xml_string; it is swapped only
    for the duration of the build."""
    from robosuite.utils.binding_utils import MjSim

    original = MjSim.__dict__["from_xml_string"]

    def from_xml_string(cls: type, xml: str) -> Any:
        model = compile_model(xml, cache_dir)
        if offsamples is not None:
            model.vis.quality.offsamples = offsamples
        return cls(model)

    MjSim.from_xml_string = classmethod(from_xml_string)
    try:
        yield
    finally:
        MjSim.from_xml_string = original


def compile_model(xml: str, cache_dir: Path | None) -> Any:
    """mujoco.MjModel.from_xml_string(xml), via `cache_dir`/<sha256 of xml + MuJoCo version>.mjb.

    The XML names every asset by its absolute path, so the key changes with the install.
    Written to a temp name and renamed: env processes building at once never read half a file."""
    import mujoco

    if cache_dir is None:
        return mujoco.MjModel.from_xml_string(xml)
    key = hashlib.sha256(f"{mujoco.__version__}\n{xml}".encode()).hexdigest()
    path = Path(cache_dir).expanduser() / f"{key}.mjb"
    if path.is_file():
        try:
            return mujoco.MjModel.from_binary_path(str(path))
        except Exception:  # unreadable (another MuJoCo build, a damaged file): compile anew
            pass
    model = mujoco.MjModel.from_xml_string(xml)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mujoco.mj_saveModel(model, str(tmp), None)  # ~250 MB: LIBERO's textures, decoded
        os.replace(tmp, path)
    except (OSError, ValueError) as err:  # a full disk or a read-only folder: just not cached
        with contextlib.suppress(OSError):
            tmp.unlink()
        warnings.warn(f"env.model_cache: could not write {path}: {err}", stacklevel=2)
    return model


class LiberoEnv:
    """A persistent LIBERO env for one task: reset(init) -> [render/proprio, step]* -> reset ..."""

    @timing.timed("env_build")
    def __init__(
        self,
        task: Task,
        render_size: int = 256,
        settle_steps: int = 30,
        seed: int = 0,
        msaa: bool = False,
        model_cache: Path | str | None = None,
    ):
        """msaa False renders without multisampling (half the render time on a CPU
        renderer; edges differ by a few levels). model_cache: a folder of compiled scene
        models (.mjb, see compile_model), None to compile every build."""
        if "MUJOCO_GL" not in os.environ:
            raise RuntimeError("set MUJOCO_GL (egl or osmesa) before creating a LiberoEnv")
        with timing.phase("import"):  # the first build imports robosuite and LIBERO
            from libero.libero.envs import OffScreenRenderEnv

        self.task = task
        self.render_size = render_size
        self.settle_steps = settle_steps
        self.msaa = msaa
        t0 = time.perf_counter()
        np.random.seed(seed)  # robosuite's placement samplers draw from numpy's global RNG
        cache = None if model_cache is None else Path(model_cache)
        with _model_loading(None if msaa else 0, cache):
            self.env = OffScreenRenderEnv(
                bddl_file_name=str(task.bddl_path()),
                camera_names=list(CAMERAS),
                camera_heights=render_size,
                camera_widths=render_size,
                use_camera_obs=True,  # gated below: renders only when asked
                hard_reset=False,  # soft reset keeps sim and GL context: 0.5 s, not 4-6 s
                horizon=max(DEFAULT_HORIZON, settle_steps + task.max_steps),
            )
        self._render_on = False
        self._gate_camera_sensors()
        self.init_states = task.init_states()
        self.creation_s = time.perf_counter() - t0
        self._obs: dict[str, Any] | None = None
        self._raw: tuple[np.ndarray, np.ndarray] | None = None  # last rendered camera pair
        self.steps_taken = 0  # policy env steps since the last reset (settle steps excluded)

    def _gate_camera_sensors(self) -> None:
        blank = np.zeros((self.render_size, self.render_size, 3), np.uint8)
        for cam in CAMERAS:
            observable = self._robosuite_env._observables[f"{cam}_image"]
            render = timing.timed("render")(observable._sensor)  # inside a step's time

            def gated(obs_cache: dict, render: Any = render) -> np.ndarray:
                return render(obs_cache) if self._render_on else blank

            gated.__modality__ = render.__modality__  # robosuite reads it off the sensor
            observable._sensor = gated

    def _observe(self, fn: Any, *args: Any, render: bool) -> Any:
        """Run an env call with the camera sensors on or off; keep the images it observed."""
        self._render_on = render
        try:
            out = fn(*args)
        finally:
            self._render_on = False
        obs = out[0] if isinstance(out, tuple) else out
        self._obs = obs
        if render:
            self._raw = tuple(np.array(obs[f"{c}_image"]) for c in CAMERAS)
        return out

    @property
    def sim(self) -> Any:
        return self.env.sim

    @property
    def _robosuite_env(self) -> Any:
        return self.env.env

    @property
    def horizon(self) -> int:
        return self._robosuite_env.horizon

    @property
    def steps_left(self) -> int:
        """Env steps left before robosuite's horizon (stepping past it raises)."""
        return self.horizon - self._robosuite_env.timestep

    def _reset_sim(self, attempts: int = 100) -> None:
        # LIBERO's ControlEnv.reset retries forever and its `finally: continue` swallows
        # every exception; retry only placement failures, and only a bounded number of times.
        from robosuite.utils.errors import RandomizationError

        for _ in range(attempts):
            try:
                self._robosuite_env.reset()
                return
            except RandomizationError:
                continue
        raise RuntimeError(f"{self.task.name}: object placement failed {attempts} times")

    @timing.timed("reset")
    def reset(self, init_state_index: int) -> None:
        """Soft reset, load the suite's init state, then settle with the dummy action.

        The last settle step is rendered: `render()` is then the first query's image."""
        if not 0 <= init_state_index < len(self.init_states):
            raise IndexError(f"init state {init_state_index} not in 0..{len(self.init_states) - 1}")
        # LIBERO re-places the fixtures (cabinets, stoves: fixed bodies the init-state file
        # does not hold) at every reset from the global numpy RNG. Seed it from (task, init
        # state) so that an init state is the whole initial condition: group members start
        # alike and an eval episode reproduces exactly.
        np.random.seed(
            np.random.SeedSequence([self.task.index, init_state_index]).generate_state(1)
        )
        self._reset_sim()
        # A soft reset keeps the gripper's speed-limited command from the last episode;
        # a hard reset (and a fresh env) starts it at 0. Zero it so an episode does not
        # depend on what ran before in this process.
        for robot in self._robosuite_env.robots:
            robot.gripper.current_action = np.zeros(robot.gripper.dof)
        self._raw = None
        init = self.init_states[init_state_index]
        self._observe(self.env.set_init_state, init, render=self.settle_steps == 0)
        for i in range(self.settle_steps):
            self._observe(self.env.step, DUMMY_ACTION, render=i == self.settle_steps - 1)
        self.steps_taken = 0

    def set_sim_state(self, state: np.ndarray) -> None:
        """Load a flattened MuJoCo state (as in the init-state files) and observe it (rendered)."""
        self._observe(self.env.regenerate_obs_from_state, state, render=True)

    def render_raw(self) -> tuple[np.ndarray, np.ndarray]:
        """The two cameras of the last rendered observation, exactly as robosuite's camera
        observation gives them: uint8 [S, S, 3], upside down (OpenGL rows)."""
        if self._raw is None:
            raise RuntimeError("no rendered observation yet: reset(), or step(..., render=True)")
        return self._raw

    @timing.timed("image")
    def render(self) -> np.ndarray:
        """The model image of the last rendered observation, uint8 [224, 448, 3]."""
        return model_image(*self.render_raw())

    def render_now(self) -> np.ndarray:
        """Render the sim as it is now (end of the last step; not robosuite's obs timing)."""
        s = self.render_size
        return model_image(*(self.sim.render(camera_name=c, width=s, height=s) for c in CAMERAS))

    def proprio(self) -> np.ndarray:
        """Raw proprio of the current state, float32 [8]."""
        if self._obs is None:
            raise RuntimeError("reset() first")
        return raw_proprio(self._obs)

    @timing.timed("step")
    def step(self, action: np.ndarray, render: bool = False) -> bool:
        """Execute one env action (7,); returns LIBERO's success (env.check_success()).

        render=True observes the cameras during this step; `render()` returns them after."""
        if self._obs is None:
            raise RuntimeError("reset() first")
        if self.steps_left <= 0:
            raise RuntimeError(
                f"{self.task.name}: at the env horizon ({self.horizon}); reset first"
            )
        action = np.asarray(action, dtype=np.float64)
        if action.shape != (7,):
            raise ValueError(f"expected a (7,) action, got {action.shape}")
        # LIBERO's step returns done = self._check_success(), the same call as check_success().
        _, _, success, _ = self._observe(self.env.step, action, render=render)
        self.steps_taken += 1
        return bool(success)

    def check_success(self) -> bool:
        return bool(self.env.check_success())

    def close(self) -> None:
        if getattr(self, "env", None) is not None:
            self.env.close()
            self.env = None

    def __enter__(self) -> LiberoEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
