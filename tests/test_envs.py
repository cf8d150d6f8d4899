"""The LIBERO env layer against real LIBERO (marked `libero`; ~1-2 min on 2 cores).

The task table test at the top only reads LIBERO's benchmark module (no MuJoCo) and is fast.
"""

from __future__ import annotations

import os
import signal
import time

os.environ.setdefault("MUJOCO_GL", "egl")  # before anything imports robosuite

import numpy as np
import pytest

from wamrl.contract import MODEL_HW
from wamrl.envs.conventions import (
    Normalizer,
    env_actions,
    gripper_from_env,
    model_image,
    raw_proprio,
)
from wamrl.envs.tasks import DEFAULT_TASKS_PATH, load_tasks, task_by_name

STATS = DEFAULT_TASKS_PATH.parent / "stats.json"
TASK_INDEX = 10  # libero_object 0: pick up the alphabet soup and place it in the basket


def test_task_table_matches_installed_libero():
    from libero.libero import benchmark

    tasks = load_tasks()
    assert [t.index for t in tasks] == list(range(40))
    suites = ["libero_spatial", "libero_object", "libero_goal", "libero_10"]
    for k, suite_name in enumerate(suites):
        suite = benchmark.get_benchmark(suite_name)(task_order_index=0)
        rows = tasks[10 * k : 10 * k + 10]
        assert [t.name for t in rows] == suite.get_task_names()
        assert all(t.suite == suite_name and t.suite_index == i for i, t in enumerate(rows))
        assert all(t.max_steps == (700 if suite_name == "libero_10" else 400) for t in rows)
        assert all(t.bddl_path().is_file() for t in rows)
    assert task_by_name(tasks[33].name) == tasks[33]
    assert tasks[TASK_INDEX].name.startswith("pick_up_the_alphabet_soup")


@pytest.fixture(scope="module")
def env():
    from wamrl.envs.libero_env import LiberoEnv

    t0 = time.perf_counter()
    e = LiberoEnv(load_tasks()[TASK_INDEX], msaa=True)  # MSAA on: robosuite's default
    print(f"\nenv creation {time.perf_counter() - t0:.2f} s")
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(env):
    """robosuite's own camera observations (use_camera_obs=True, 256 px), same task."""
    from libero.libero.envs import OffScreenRenderEnv

    ref = OffScreenRenderEnv(
        bddl_file_name=str(env.task.bddl_path()), camera_heights=256, camera_widths=256
    )
    ref.reset()
    yield ref
    ref.close()


def _project(sim, camera: str, point: np.ndarray, size: int) -> tuple[float, float]:
    """Pinhole projection of a world point into the camera (row from the top, column)."""
    cid = sim.model.camera_name2id(camera)
    pos, rot = sim.data.cam_xpos[cid], sim.data.cam_xmat[cid].reshape(3, 3)
    pc = rot.T @ (point - pos)  # MuJoCo cameras look along -z, +y is up, +x is right
    f = (size / 2) / np.tan(np.deg2rad(sim.model.cam_fovy[cid]) / 2)
    return size / 2 - f * pc[1] / -pc[2], size / 2 + f * pc[0] / -pc[2]


@pytest.mark.libero
def test_render_matches_robosuite_camera_obs(env, reference):
    import robosuite.macros

    assert robosuite.macros.IMAGE_CONVENTION == "opengl"  # raw images are bottom-row first
    # Same episode in both envs: init state 3, 30 settle steps, then 5 arm actions. The
    # reference renders inside step() (after mj_step, like Fast-WAM's eval observations);
    # ours renders on demand afterwards: the pixels must be identical.
    from wamrl.envs.conventions import DUMMY_ACTION

    rng = np.random.default_rng(1)
    actions = [np.r_[rng.uniform(-0.5, 0.5, 6), -1.0] for _ in range(5)]
    env.reset(3)
    reference.reset()
    reference.set_init_state(env.init_states[3])
    for _ in range(env.settle_steps):
        obs, _, _, _ = reference.step(DUMMY_ACTION)
    assert np.array_equal(
        env.render(), model_image(obs["agentview_image"], obs["robot0_eye_in_hand_image"])
    )
    for i, a in enumerate(actions):
        env.step(a, render=i == len(actions) - 1)
        obs, _, _, _ = reference.step(a)
    # Rendering after the step instead is measurably different (the sampling-time shift).
    assert not np.array_equal(env.render_now(), env.render())
    agent, wrist = env.render_raw()
    assert np.array_equal(agent, obs["agentview_image"])
    assert np.array_equal(wrist, obs["robot0_eye_in_hand_image"])
    image = env.render()
    assert image.shape == (224, 448, 3) and image.dtype == np.uint8
    assert np.array_equal(
        image, model_image(obs["agentview_image"], obs["robot0_eye_in_hand_image"])
    )
    np.testing.assert_allclose(env.proprio(), raw_proprio(obs), atol=1e-6)

    t0 = time.perf_counter()
    for _ in range(3):
        env.step(DUMMY_ACTION, render=True)
    t_render = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    for _ in range(3):
        env.step(DUMMY_ACTION)
    t_plain = (time.perf_counter() - t0) / 3
    print(
        f"step {t_plain * 1e3:.0f} ms; step with render (2 cameras, MSAA on) {t_render * 1e3:.0f} ms"
    )
    assert t_render > t_plain  # the gate really skips rendering on plain steps


@pytest.mark.libero
def test_image_orientation_by_projection(env):
    """Remove the soup can from the scene: the changed pixels must sit where a pinhole
    projection puts it, upside down in the raw image, rotated 180 deg in the model image."""
    env.reset(0)
    e = env._robosuite_env
    sim = env.sim
    joint = e.objects_dict["alphabet_soup_1"].joints[-1]
    centre = sim.data.body_xpos[
        sim.model.body_name2id(e.objects_dict["alphabet_soup_1"].root_body)
    ].copy()
    state = sim.get_state().flatten()
    env.set_sim_state(state)
    before_raw, before = env.render_raw()[0], env.render()
    q = sim.data.get_joint_qpos(joint).copy()
    q[:3] = [0.0, 0.0, -5.0]  # far under the floor
    sim.data.set_joint_qpos(joint, q)
    env.set_sim_state(sim.get_state().flatten())
    after_raw, after = env.render_raw()[0], env.render()
    env.set_sim_state(state)

    row_top, col = _project(sim, "agentview", centre, 256)
    changed = np.argwhere(np.abs(after_raw.astype(int) - before_raw).sum(-1) > 30)
    r, c = changed.mean(0)
    assert abs(r - (255 - row_top)) < 12 and abs(c - col) < 12  # raw: vertically flipped
    changed = np.argwhere(
        np.abs(after[:, :MODEL_HW].astype(int) - before[:, :MODEL_HW]).sum(-1) > 30
    )
    r, c = changed.mean(0)
    s = MODEL_HW / 256
    assert abs(r - row_top * s) < 12 and abs(c - (256 - col) * s) < 12  # model: rotated 180


@pytest.mark.libero
def test_msaa_off_and_the_model_cache(env, tmp_path):
    """MSAA off (set on the model before robosuite makes its GL context) changes only edges;
    a build from the compiled-model cache renders and steps exactly like a fresh compile."""
    from wamrl.envs.libero_env import LiberoEnv

    def run(e: LiberoEnv) -> tuple[np.ndarray, np.ndarray]:
        e.reset(0)
        frames = [e.render()]
        for _ in range(3):
            e.step(np.array([0.5, 0, 0, 0, 0, 0, -1.0]), render=True)
            frames.append(e.render())
        return np.stack(frames), e.proprio()

    on = run(env)
    builds = []
    for _ in range(2):  # compiles and writes the .mjb, then loads it
        t0 = time.perf_counter()
        with LiberoEnv(env.task, model_cache=tmp_path) as e:
            builds.append(time.perf_counter() - t0)
            off = run(e)
            assert e.sim.model.vis.quality.offsamples == 0
        if len(builds) == 1:
            first = off
    print(f"env build: compile {builds[0]:.2f} s, from the cache {builds[1]:.2f} s")
    env.sim._render_context_offscreen.gl_ctx.make_current()  # the module's env renders on
    assert len(list(tmp_path.glob("*.mjb"))) == 1
    assert np.array_equal(first[0], off[0]) and np.array_equal(first[1], off[1])
    diff = np.abs(off[0].astype(int) - on[0]).mean()
    assert 0 < diff < 4.0, diff  # antialiased edges only
    np.testing.assert_allclose(off[1], on[1], atol=1e-5)  # rendering never touches physics


def test_compile_model_cache_survives_a_damaged_file(tmp_path, monkeypatch):
    import mujoco

    monkeypatch.chdir(tmp_path)  # MuJoCo logs the failed load to ./MUJOCO_LOG.TXT

    from wamrl.envs.libero_env import compile_model

    xml = "<mujoco><worldbody><body><freejoint/><geom size='0.1'/></body></worldbody></mujoco>"
    fresh = compile_model(xml, None)
    first = compile_model(xml, tmp_path)
    (path,) = tmp_path.glob("*.mjb")
    cached = compile_model(xml, tmp_path)
    for m in (first, cached):
        assert m.nbody == fresh.nbody and np.array_equal(m.geom_size, fresh.geom_size)
    path.write_bytes(b"not a model")  # e.g. written by another MuJoCo build
    again = compile_model(xml, tmp_path)
    assert again.nbody == fresh.nbody
    assert isinstance(mujoco.MjModel.from_binary_path(str(path)), mujoco.MjModel)  # rewritten
    assert not list(tmp_path.glob(".*.tmp"))
    assert len(list(tmp_path.glob("*.mjb"))) == 1
    blocked = tmp_path / "a_file"  # a cache folder that cannot be made: warned, not fatal
    blocked.write_text("")
    with pytest.warns(UserWarning, match="could not write"):
        assert compile_model(xml, blocked / "cache").nbody == fresh.nbody


@pytest.mark.libero
def test_proprio_round_trip_through_normalizer(env):
    norm = Normalizer.load(STATS)
    env.reset(1)
    raw = env.proprio()
    normed = norm.normalize_state(raw)
    assert normed.dtype == np.float32 and np.all(np.abs(normed) <= 5)
    np.testing.assert_allclose(norm.denormalize_state(normed), raw, atol=1e-5)


@pytest.mark.libero
def test_action_round_trip_and_gripper_convention(env):
    norm = Normalizer.load(STATS)
    rng = np.random.default_rng(0)
    lo = np.asarray(norm.stats["action"][norm.action_key]["min"])
    hi = np.asarray(norm.stats["action"][norm.action_key]["max"])
    # Env-unit actions -> data convention -> normalised chunk -> env_actions gives them back.
    acts = np.empty((32, 7))
    acts[:, :6] = lo[:6] + rng.random((32, 6)) * (hi[:6] - lo[:6])
    acts[:, 6] = np.where(rng.random(32) < 0.5, -1.0, 1.0)
    data = acts.copy()
    data[:, 6] = gripper_from_env(acts[:, 6])
    chunk = norm.normalize_action(data)
    np.testing.assert_allclose(env_actions(chunk, norm), acts[:10], atol=1e-6)

    # Physically: a normalised gripper of +1 (data 1 = open) must open the fingers,
    # -1 (data 0 = closed) must close them (gripper_qpos is +/- finger opening).
    def opening_after(gripper_norm: float) -> float:
        env.reset(0)
        chunk = norm.normalize_action(np.tile(np.r_[np.zeros(6), 0.5], (32, 1)))
        chunk[:, 6] = gripper_norm
        for a in np.concatenate([env_actions(chunk, norm)] * 2):
            env.step(a)
        g = env.proprio()[6:]
        return float(g[0] - g[1])

    open_, closed = opening_after(1.0), opening_after(-1.0)
    assert open_ > 0.07 and closed < 0.03, (open_, closed)


@pytest.mark.libero
def test_success_when_object_is_in_basket(env):
    env.reset(0)
    e = env._robosuite_env
    obj, basket = e.obj_of_interest  # libero_object: (the object, the basket)
    assert e.parsed_problem["goal_state"] == [["in", obj, f"{basket}_contain_region"]]
    from wamrl.envs.conventions import DUMMY_ACTION

    assert env.step(DUMMY_ACTION) is False
    sim = env.sim
    joint = e.objects_dict[obj].joints[-1]
    basket_pos = sim.data.body_xpos[sim.model.body_name2id(e.objects_dict[basket].root_body)]
    q = sim.data.get_joint_qpos(joint).copy()
    q[:3] = basket_pos + np.array([0.0, 0.0, 0.08])
    sim.data.set_joint_qpos(joint, q)
    sim.forward()
    successes = [env.step(DUMMY_ACTION) for _ in range(10)]
    assert any(successes) and env.check_success()
    assert env.steps_taken == 11


@pytest.mark.libero
def test_reset_timing_and_horizon_guard(env):
    from wamrl.envs.conventions import DUMMY_ACTION

    t0 = time.perf_counter()
    env.reset(2)
    t_reset = time.perf_counter() - t0
    n = 40
    t0 = time.perf_counter()
    for _ in range(n):
        env.step(DUMMY_ACTION)
    print(
        f"soft reset + 30 settle steps {t_reset:.2f} s; {n / (time.perf_counter() - t0):.0f} env steps/s"
    )
    assert env.steps_left == env.horizon - env.settle_steps - n
    e = env._robosuite_env
    e.timestep = env.horizon  # pretend we are at the horizon: step must refuse, not robosuite
    with pytest.raises(RuntimeError, match="horizon"):
        env.step(DUMMY_ACTION)
    env.reset(2)
    assert env.steps_left == env.horizon - env.settle_steps


@pytest.mark.libero
def test_reset_is_the_whole_initial_condition(env):
    """LIBERO re-places fixed fixtures from the global RNG at each reset; ours is seeded per
    (task, init state), so the same init state renders the same scene whatever ran before."""
    env.reset(3)
    first, pos = env.render(), env.sim.model.body_pos.copy()
    np.random.seed(12345)  # whatever the RNG holds before the reset must not matter
    env.reset(1)
    env.reset(3)
    np.testing.assert_array_equal(env.sim.model.body_pos, pos)
    np.testing.assert_array_equal(env.render(), first)


@pytest.mark.libero
def test_pool_frames_and_crash_recovery(env):
    from wamrl.envs.pool import Crashed, EnvPool, Query, StepResult

    task = load_tasks()[TASK_INDEX]
    cfg = {"mujoco_gl": os.environ["MUJOCO_GL"], "render_size": 256, "settle_steps": 30,
           "replan_steps": 10, "max_macro_steps": 2, "msaa": True}  # fmt: skip
    rng = np.random.default_rng(5)
    actions = np.c_[rng.uniform(-0.5, 0.5, (10, 6)), -np.ones(10)]

    def next_events(pool, want):
        for _ in range(20):
            events = pool.poll(120)
            if events:
                assert all(isinstance(e, want) for e in events), events
                return events
        raise AssertionError("no event")

    with EnvPool(1, STATS, cfg) as pool:
        pool.start_episode(0, task, 4, record_video=True, max_macro_steps=2)
        (query,) = next_events(pool, Query)
        env.reset(4)  # the same episode locally: frames must match step for step
        assert np.array_equal(query.image, env.render())
        np.testing.assert_array_equal(query.proprio_raw, env.proprio())
        pool.send_chunk(0, actions)
        events = next_events(pool, (StepResult, Query))
        if len(events) == 1:
            events += next_events(pool, Query)
        result, query2 = events
        local = []
        for a in actions:
            env.step(a, render=True)
            local.append(env.render())
        assert not result.done and not result.success and result.env_steps == 10
        assert np.array_equal(result.frames[0], local[3]) and np.array_equal(
            result.frames[1], local[7]
        )
        assert result.video.shape == (10, 224, 448, 3) and np.array_equal(
            result.video, np.stack(local)
        )
        assert np.array_equal(query2.image, local[-1])

        # Kill the worker mid-episode: the parent gets Crashed, not an exception.
        old_pid = pool.pids()[0]
        os.kill(old_pid, signal.SIGKILL)
        pool.send_chunk(0, actions)
        (crash,) = next_events(pool, Crashed)
        assert crash.slot == 0 and ("died" in crash.error or "unreachable" in crash.error)

        # The next episode restarts the worker transparently and runs to its macro-step cap.
        pool.start_episode(0, task, 0, record_video=False, max_macro_steps=1)
        (query,) = next_events(pool, Query)
        assert pool.pids()[0] not in (None, old_pid)
        pool.send_chunk(0, actions)
        (result,) = next_events(pool, StepResult)
        assert result.done and result.video is None and result.frames.shape == (2, 224, 448, 3)

        # Eval skips the +4/+8 renders: the frames repeat the query image, none is new.
        pool.start_episode(0, task, 0, max_macro_steps=1, record_frames=False)
        (query,) = next_events(pool, Query)
        pool.send_chunk(0, actions)
        (result,) = next_events(pool, StepResult)
        assert result.done and (result.frames == query.image[None]).all()


def test_pool_reuses_an_env_after_a_full_budget_episode(env):
    """A libero_10 episode uses 700 of the env's 1000 steps; the next episode in the same
    process must start (the horizon is checked after the reset, not before)."""
    from wamrl.envs.pool import EnvPool, Query, StepResult

    task = load_tasks()[30]
    cfg = {"mujoco_gl": os.environ["MUJOCO_GL"], "render_size": 128, "settle_steps": 30,
           "replan_steps": 10}  # fmt: skip
    hold = np.zeros((10, 7))
    hold[:, 6] = -1.0
    with EnvPool(1, STATS, cfg) as pool:
        for episode in range(2):
            pool.start_episode(0, task, episode, record_frames=False)
            steps, done = 0, False
            while not done:
                for ev in pool.poll(120):
                    if isinstance(ev, Query):
                        pool.send_chunk(0, hold)
                        continue
                    assert isinstance(ev, StepResult), ev
                    steps += ev.env_steps
                    done = ev.done
            assert steps == task.max_steps == 700
