"""The rollout and eval stages on real LIBERO (CPU, tiny settings), read back independently.

One module-scoped run: init -> one rollout shard (one group of G = 2 episodes x 3
macro-steps). The store is then checked the way an outside tool would: `wamrl inspect`,
the contract's arrays, and log pi_old recomputed from the stored chains.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from tests.helpers import micro_cfg
from wamrl import paths
from wamrl.atomic import sha256_file

pytestmark = pytest.mark.libero


def stage_cfg(**overrides):
    """tests/micro.yaml at one worker's shard: one group of G = 2 episodes x 3 macro-steps."""
    base = {
        "rollout.workers": 1,
        "rollout.groups": 1,
        "rollout.group_size": 2,
        "rollout.envs_per_worker": 2,
        "rollout.video_sft_share": 0.5,
        "env.max_macro_steps": 3,
        "env.mujoco_gl": os.environ.get("MUJOCO_GL", "egl"),
    }
    return micro_cfg({**base, **overrides})


@pytest.fixture(scope="module")
def rollout_run(tmp_path_factory):
    import stages.init
    import stages.rollout

    cfg = stage_cfg()
    run = tmp_path_factory.mktemp("stages")
    stages.init.main(cfg, run)
    stages.rollout.main(cfg, run, iteration=1, worker=0)
    return run, cfg


def test_rollout_store_passes_inspect(rollout_run, capsys):
    from wamrl.inspect import inspect_store

    run, _ = rollout_run
    shard = paths.shard_path(run, 1, 0)
    assert inspect_store(shard, deep=True) == 0
    assert "matches the episode-store contract" in capsys.readouterr().out
    assert not [p for p in shard.parent.iterdir() if p.name.startswith(".")], "temp left behind"


def test_rollout_store_contents(rollout_run):
    run, cfg = rollout_run
    g = zarr.open_group(str(paths.shard_path(run, 1, 0)), mode="r")
    attrs = dict(g.attrs)
    pdir = paths.policy_dir(run, 0)
    assert attrs["iteration"] == 1 and attrs["shard"] == 0 and attrs["K"] == cfg["sampler"]["K"]
    assert attrs["G"] == 2 and attrs["a"] == cfg["sampler"]["noise_a"]
    assert attrs["policy_sha256"] == sha256_file(pdir / "model.safetensors")
    assert attrs["config"]["rollout"]["group_size"] == 2

    task, init, group = (np.asarray(g[f"episode/{n}"][:]) for n in ("task", "init_state", "group"))
    assert len(task) == 2 and len(set(task)) == 1 and len(set(init)) == 1 and len(set(group)) == 1
    length = np.asarray(g["episode/length"][:])
    valid = np.asarray(g["step/valid"][:])
    assert (length == 3).all(), "no episode can succeed or end in 3 macro-steps from random weights"
    np.testing.assert_array_equal(valid.sum(1), length)
    done = np.asarray(g["step/done"][:])
    assert done.sum() == 2 and all(done[e, length[e] - 1] for e in range(2))
    k_star = np.asarray(g["step/k_star"][:])
    K = cfg["sampler"]["K"]
    assert ((k_star[valid] >= 1) & (k_star[valid] <= K - 1)).all()
    for name in ("image", "frames"):
        arr = g[f"step/{name}"]
        assert arr.dtype == np.uint8 and arr.metadata.dimension_names[0] == "episode"
    frames = np.asarray(g["step/frames"][0])
    image = np.asarray(g["step/image"][0])
    assert frames.shape[1:] == (2, 224, 448, 3) and frames[:3].std() > 10
    # the query image of macro-step t+1 is the frame 10 env steps after query t: it differs
    # from the +8 frame of step t but not by much (two env steps of motion)
    assert not np.array_equal(image[1], frames[0, 1])
    assert np.abs(image[1].astype(int) - frames[0, 1].astype(int)).mean() < 20
    video_sft = np.asarray(g["episode/video_sft"][:])
    vlen = np.asarray(g["video/length"][:])
    np.testing.assert_array_equal(vlen[video_sft], 3 * 10 + 1)
    assert (vlen[~video_sft] == 0).all()


def test_stored_log_probs_recompute(rollout_run):
    """An independent reader: log pi(x_{k*+1} | x_{k*}) from the stored chain = logp_old."""
    from wamrl.envs.conventions import image_to_model_input
    from wamrl.policy import load_policy
    from wamrl.policy.base import Obs
    from wamrl.policy.text import load_contexts
    from wamrl.sampler import recompute_log_prob

    run, cfg = rollout_run
    g = zarr.open_group(str(paths.shard_path(run, 1, 0)), mode="r")
    valid = np.asarray(g["step/valid"][:])
    e, t = np.nonzero(valid)
    image = np.asarray(g["step/image"][:])[e, t]
    proprio = np.asarray(g["step/proprio"][:])[e, t]
    chain = torch.from_numpy(np.asarray(g["step/chain"][:])[e, t])
    k_star = torch.from_numpy(np.asarray(g["step/k_star"][:])[e, t]).long()
    logp_old = torch.from_numpy(np.asarray(g["step/logp_old"][:])[e, t])
    task = torch.from_numpy(np.asarray(g["episode/task"][:])[e]).long()
    pdir = paths.policy_dir(run, 0)
    policy = load_policy(pdir).eval()
    ctx, mask = load_contexts(pdir / "context.safetensors")
    obs = Obs(image_to_model_input(image), torch.from_numpy(proprio), ctx[task], mask[task])
    rows = torch.arange(len(e))
    s = cfg["sampler"]
    with torch.no_grad():
        logp = recompute_log_prob(
            policy, obs, chain[rows, k_star], chain[rows, k_star + 1], k_star,
            s["K"], s["noise_a"], s["shift"],
        )  # fmt: skip
    assert torch.isfinite(logp_old).all() and logp_old.abs().max() > 0
    torch.testing.assert_close(logp, logp_old, atol=1e-4, rtol=1e-5)
    # the last chain entry is the action chunk the env executed; it is not pure noise
    assert not torch.allclose(chain[:, -1], chain[:, 0])


def test_eval_two_tasks_writes_contract_json(rollout_run):
    import stages.eval

    run, _ = rollout_run
    cfg = stage_cfg(**{"eval.tasks": [0, 10], "eval.envs": 2, "eval.videos": 1})
    stages.eval.main(cfg, run, iteration=0)
    report = json.loads(paths.eval_json(run, 0).read_text())
    assert set(report) == {
        "iteration", "checkpoint_sha256", "episodes_per_task", "protocol", "tasks", "suites",
        "average", "env_crashed", "reference", "wall_time_s", "first_query_s", "config",
    }  # fmt: skip
    assert report["protocol"] == {
        "name": "wamrl", "K": 20, "noise": "per_episode", "msaa": False,
        "episodes_per_task": 1, "max_macro_steps": 1, "scheduler_dtype": "float32",
    }  # fmt: skip
    assert report["reference"] is None  # micro.yaml starts from a fresh model
    assert 0 < report["first_query_s"] < report["wall_time_s"]
    assert report["env_crashed"] == 0
    assert report["iteration"] == 0 and report["episodes_per_task"] == 1
    assert report["checkpoint_sha256"] == sha256_file(
        paths.policy_dir(run, 0) / "model.safetensors"
    )
    assert len(report["tasks"]) == 2
    assert {v["suite"] for v in report["tasks"].values()} == {"libero_spatial", "libero_object"}
    assert all(v["episodes"] == 1 and 0 <= v["success_rate"] <= 1 for v in report["tasks"].values())
    assert all(v["outcomes"] == [v["success_rate"] == 1] for v in report["tasks"].values())
    assert set(report["suites"]) == {"libero_spatial", "libero_object"}
    assert report["config"]["eval"]["tasks"] == [0, 10]
    videos = list((paths.iter_dir(run, 0) / "eval_videos").glob("*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 1000


def _run(
    policy, pool, specs, cfg, sampler, on_episode, max_macro_steps=2, lockstep=False,
    fixed_batch=False,
):  # fmt: skip
    from wamrl.envs.conventions import Normalizer
    from wamrl.policy.text import load_contexts
    from wamrl.rollout import run_episodes

    pdir = Path(cfg["_pdir"])
    ctx, mask = load_contexts(pdir / "context.safetensors")
    return run_episodes(
        policy, pool, specs, ctx, mask, Normalizer.load(pdir / "stats.json"), sampler,
        max_macro_steps, seed=0, on_episode=on_episode, device=torch.device("cpu"),
        lockstep=lockstep, fixed_batch=fixed_batch,
    )  # fmt: skip


def test_eval_noise_is_reproducible_and_killed_env_truncates(rollout_run):
    """Per-episode noise seeds and batches padded to a fixed size (eval) give bitwise identical
    chains run to run, in lockstep or async (other batches); a killed env process ends its
    episode as failed and truncated while the run goes on."""
    from wamrl.envs.pool import EnvPool
    from wamrl.envs.tasks import load_tasks
    from wamrl.policy import load_policy
    from wamrl.rollout import EpisodeSpec, SamplerSettings

    run, cfg = rollout_run
    pdir = paths.policy_dir(run, 0)
    cfg = {**cfg, "_pdir": str(pdir)}
    policy = load_policy(pdir).eval()
    task = load_tasks()[0]
    specs = [EpisodeSpec(task, i, i, noise_seed=100 + i) for i in range(2)]
    ode = SamplerSettings(4, 0.0, 5.0)
    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the eval stage: row results then do not depend on the batch
    with EnvPool(2, pdir / "stats.json", dict(cfg["env"])) as pool:
        for lockstep in (True, False):
            got = {}
            _run(policy, pool, specs, cfg, ode, got.__setitem__, 2, lockstep, fixed_batch=True)
            results.append(got)

        # crash: kill episode 0's env process when its second chunk is about to be sent
        sent = {"n": 0}
        send = pool.send_chunk

        def send_and_kill(slot, actions):
            sent["n"] += 1
            if sent["n"] == 3:  # chunks 1-2 are both episodes' first; 3 is a second chunk
                os.kill(pool.pids()[slot], signal.SIGKILL)
            send(slot, actions)

        pool.send_chunk = send_and_kill
        crash_specs = [EpisodeSpec(task, i, 0) for i in range(3)]
        eps = {}
        stats = _run(
            policy, pool, crash_specs, cfg, SamplerSettings(4, 0.5, 5.0), eps.__setitem__, 2
        )
    torch.set_num_threads(threads)
    for i in range(2):
        np.testing.assert_array_equal(results[0][i].chain, results[1][i].chain)
    assert not np.array_equal(results[0][0].chain, results[0][1].chain)
    assert stats["crashed"] == 1 and len(eps) == 3
    crashed = [d for d in eps.values() if d.env_crashed]
    assert len(crashed) == 1
    c = crashed[0]
    assert not c.success and c.length == 1 and c.done[-1] and c.video_frames is None
    assert all(d.length == 2 and not d.env_crashed for d in eps.values() if d is not c)


def test_rollout_reruns_bitwise_and_records_its_plan(rollout_run, tmp_path):
    """Two clean rollouts of one config with 2 envs per worker: every array equal to the bit
    (each episode's x_0, k* and SDE noise come from its own seed, batches are padded to the
    pool size); the plan recomputed from the store's attrs is the episodes it holds."""
    import shutil

    import stages.rollout
    from wamrl.plan import plan_from_attrs
    from wamrl.store import SCHEMA

    run, cfg = rollout_run
    assert cfg["rollout"]["envs_per_worker"] == 2
    shutil.copytree(paths.policy_dir(run, 0), paths.policy_dir(tmp_path, 0))
    stages.rollout.main(cfg, tmp_path, iteration=1, worker=0)
    a = zarr.open_group(str(paths.shard_path(run, 1, 0)), mode="r")
    b = zarr.open_group(str(paths.shard_path(tmp_path, 1, 0)), mode="r")
    for spec in SCHEMA:
        if spec.group != "reward":
            np.testing.assert_array_equal(a[spec.path][:], b[spec.path][:], err_msg=spec.path)
    assert a.attrs["plan"] == b.attrs["plan"]
    specs = plan_from_attrs(dict(a.attrs), worker=0)
    got = [(int(t), int(i), int(g), bool(v)) for t, i, g, v in zip(
        *(a[f"episode/{n}"][:] for n in ("task", "init_state", "group", "video_sft")),
        strict=True,
    )]  # fmt: skip
    assert sorted(got) == sorted(
        (s.task.index, s.init_state, s.group, s.record_video) for s in specs
    )


def test_rollout_episode_noise_does_not_depend_on_order_or_env(rollout_run):
    """The same rollout episodes (a > 0) started in another order land on other envs and in
    other batches: each keeps its chain, k*, log pi and images, bit for bit, as its noise
    comes from its own seed. (A generator shared by the run fails this: whichever episode
    queries first takes the first draws.)"""
    from wamrl.envs.pool import EnvPool
    from wamrl.envs.tasks import load_tasks
    from wamrl.policy import load_policy
    from wamrl.rollout import EpisodeSpec, SamplerSettings

    run, cfg = rollout_run
    pdir = paths.policy_dir(run, 0)
    cfg = {**cfg, "_pdir": str(pdir)}
    policy = load_policy(pdir).eval()
    task = load_tasks()[0]
    specs = [EpisodeSpec(task, i % 2, i, noise_seed=7 + i) for i in range(3)]
    sde = SamplerSettings(4, 0.5, 5.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the rollout stage
    results = []
    with EnvPool(2, pdir / "stats.json", dict(cfg["env"])) as pool:
        for order in ([0, 1, 2], [2, 1, 0]):
            got = {}
            _run(
                policy, pool, [specs[i] for i in order], cfg, sde,
                lambda j, d, order=order, got=got: got.__setitem__(order[j], d),
                2, fixed_batch=True,
            )  # fmt: skip
            results.append(got)
    torch.set_num_threads(threads)
    for i in range(3):
        a, b = results[0][i], results[1][i]
        for name in ("chain", "k_star", "logp_old", "image", "frames"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert not np.array_equal(results[0][0].chain, results[0][1].chain)
