"""Task success stays dominant over reconstruction reward (docs/design.md "Reward"), and the
world model trains on normalised proprio.

r = r^task + beta * (1 - gamma) * clip(r~^rec, -c, c): the reconstruction part of any return
is at most B(n) = beta * c * (1 - gamma^n), so a success n steps ahead (worth gamma^(n-1))
beats every failing member iff gamma^(T-1) > 2 * B(T).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from wamrl import advantages as A
from wamrl import paths, store
from wamrl.envs.conventions import Normalizer
from wamrl.reward import ShardRewardInputs, compute_advantages

ROOT = Path(__file__).resolve().parents[1]
BETA, GAMMA, CLIP = 0.1, 0.99, 3.0
T_STORE, SUCCESS_STEP = 40, 35


def worst_case_group(z_fail: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """G = 4, T = 40: episode 0 succeeds at step 35 with r~^rec = -3 at every step (worst
    for it); episodes 1..3 fail after all 40 steps with r~^rec = z_fail at every step."""
    valid = np.ones((4, T_STORE), bool)
    valid[0, SUCCESS_STEP + 1 :] = False
    r_task = np.zeros((4, T_STORE), np.float32)
    r_task[0, SUCCESS_STEP] = 1.0
    z = np.where(valid, z_fail, 0.0).astype(np.float32)
    z[0] = np.where(valid[0], -CLIP, 0.0)
    return valid, r_task, z


def assert_success_beats_failures(returns: np.ndarray, valid: np.ndarray) -> None:
    for t in np.flatnonzero(valid[0]):
        assert returns[0, t] > returns[1:, t].max(), t


@pytest.mark.parametrize("z_fail", [3.0, 10.0])  # at the clip, and far beyond it
def test_success_dominates_long_failures(z_fail: float) -> None:
    valid, r_task, z = worst_case_group(z_fail)
    gamma = np.full(4, GAMMA)
    R = A.discounted_returns(A.combine(r_task, z, BETA, gamma, CLIP), valid, gamma)
    assert_success_beats_failures(R, valid)
    # The returns are the bound's terms: B(n) = beta * c * (1 - gamma^n).
    assert R[1, 0] == pytest.approx(BETA * CLIP * (1 - GAMMA**T_STORE), rel=1e-5)
    n = SUCCESS_STEP + 1
    assert R[0, 0] == pytest.approx(GAMMA ** (n - 1) - BETA * CLIP * (1 - GAMMA**n), rel=1e-5)
    adv = A.group_advantages(R, valid, np.zeros(4, int))
    for t in np.flatnonzero(valid[0]):
        assert adv[0, t] > 0 > adv[1:, t].max()
    assert A.success_dominates(BETA, GAMMA, CLIP, T_STORE)


def test_episode_scale_keeps_reconstruction_advantages_small_after_successes_end() -> None:
    """Steps 36..39: the success has ended and three failures differ only by r~^rec. Per-step
    scaling makes that difference +-1.2, as large as success against failure; scaling by
    the spread of whole-episode returns keeps it below 2 * B(T) / std(R_0)."""
    valid, r_task, z = worst_case_group(0.0)
    z[1:] = np.where(valid[1:], np.array([[-1.0], [0.0], [1.0]]), 0.0)  # failures' z-scores
    gamma = np.full(4, GAMMA)
    R = A.discounted_returns(A.combine(r_task, z, BETA, gamma, CLIP), valid, gamma)
    step = A.group_advantages(R, valid, np.zeros(4, int))
    episode = A.group_advantages(R, valid, np.zeros(4, int), scale="episode")
    late = slice(SUCCESS_STEP + 1, T_STORE)
    np.testing.assert_allclose(
        np.abs(step[1:, late]).max(axis=0), np.sqrt(1.5), rtol=5e-3
    )  # up to eps
    bound = 2 * BETA * CLIP * (1 - GAMMA**T_STORE) / R[:, 0].astype(np.float64).std()
    assert np.abs(episode[1:, late]).max() < 0.02 < bound
    # While the success is alive it still stands out: A_success > 1 > every failure's A.
    early = slice(0, SUCCESS_STEP + 1)
    assert (episode[0, early] > 1.0).all() and (episode[1:, early] < 0).all()


def test_old_formula_lets_failures_outweigh_success() -> None:
    """r = r^task + beta * r~^rec (no (1 - gamma), no clip) fails the same check."""
    valid, r_task, z = worst_case_group(3.0)
    R = A.discounted_returns(r_task + BETA * z, valid, np.full(4, GAMMA))
    assert R[1, 0] > R[0, 0]  # ~9.9 z-return of a long failure vs a success worth ~0.70
    with pytest.raises(AssertionError):
        assert_success_beats_failures(R, valid)


@pytest.mark.parametrize("gamma", [0.99, 0.995])
def test_margin_is_tight(gamma: float) -> None:
    """Just under the largest passing beta the worst case holds; just over, it breaks."""
    T = T_STORE
    beta_max = gamma ** (T - 1) / (2 * CLIP * (1 - gamma**T))
    valid = np.ones((2, T), bool)
    r_task = np.zeros((2, T), np.float32)
    r_task[0, T - 1] = 1.0  # the success as far ahead as the horizon allows
    z = np.array([[-CLIP] * T, [CLIP] * T], np.float32)
    g = np.full(2, gamma)
    for beta, ok in ((beta_max * 0.99, True), (beta_max * 1.01, False)):
        assert A.success_dominates(beta, gamma, CLIP, T) is ok
        R = A.discounted_returns(A.combine(r_task, z, beta, g, CLIP), valid, g).astype(float)
        assert bool(R[0, 0] > R[1, 0]) is ok
        margin = A.success_margin(beta, gamma, CLIP, T)
        assert margin == pytest.approx(R[0, 0] - R[1, 0], rel=1e-3, abs=1e-5)


def test_success_dominates_large_beta_and_beta0() -> None:
    assert not A.success_dominates(2.0, GAMMA, CLIP, T_STORE)
    assert A.success_margin(2.0, GAMMA, CLIP, T_STORE) == pytest.approx(
        GAMMA ** (T_STORE - 1) - 2 * 2.0 * CLIP * (1 - GAMMA**T_STORE)
    )
    assert A.success_dominates(0.0, 1e-3, CLIP, 10_000)  # beta = 0 always passes
    with pytest.raises(ValueError, match=r"reward\.beta=2\.0.*reward\.rec_clip=3\.0.*"):
        A.require_success_dominates(2.0, CLIP, {"reward.gamma": GAMMA}, T_STORE)
    with pytest.raises(ValueError, match=r"reward\.gamma_libero_10=0\.995, horizon T=70"):
        A.require_success_dominates(2.0, CLIP, {"reward.gamma_libero_10": 0.995}, 70)


def test_combine_matches_formula_per_episode_gamma() -> None:
    rng = np.random.default_rng(0)
    r_task = (rng.random((3, 5)) > 0.8).astype(np.float32)
    z = (rng.normal(size=(3, 5)) * 4).astype(np.float32)  # many beyond +-3
    gamma = np.array([0.99, 0.995, 0.9])
    out = A.combine(r_task, z, 0.2, gamma, 2.5)
    for e in range(3):
        for t in range(5):
            zc = min(max(float(z[e, t]), -2.5), 2.5)
            expected = float(r_task[e, t]) + 0.2 * (1 - gamma[e]) * zc
            assert out[e, t] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert out.dtype == np.float32


def test_combine_beta0_is_r_task_exactly() -> None:
    rng = np.random.default_rng(1)
    r_task = rng.random((3, 4)).astype(np.float32)
    z = rng.normal(size=(3, 4)).astype(np.float32) * 100
    out = A.combine(r_task, z, 0.0, np.array([0.99, 0.995, 0.99]), CLIP)
    np.testing.assert_array_equal(out, r_task)
    assert out.dtype == np.float32


def _inputs() -> ShardRewardInputs:
    valid, r_task, _ = worst_case_group(0.0)
    rng = np.random.default_rng(2)
    r_rec = np.where(valid, rng.normal(size=valid.shape), 0.0).astype(np.float32)
    return ShardRewardInputs(
        valid=valid,
        r_task=r_task,
        task=np.full(4, 3),
        group=np.zeros(4, np.int64),
        init_state=np.zeros(4, np.int64),
        success=np.array([True, False, False, False]),
        crashed=np.zeros(4, bool),
        r_rec=r_rec,
    )


def _rcfg(**kw: Any) -> dict[str, Any]:
    cfg = {
        "beta": BETA,
        "gamma": GAMMA,
        "gamma_libero_10": 0.995,
        "rec_clip": CLIP,
        "filter": "all_same",
        "zero_spread_eps": 1e-6,
        "adv_scale": "step",
    }
    return {**cfg, **kw}


def test_compute_advantages_records_bound_and_rec_share() -> None:
    s = _inputs()
    res = compute_advantages([s], _rcfg())
    summ = res.summary
    assert summ["rec_clip"] == CLIP
    assert summ["rec_scale"]["default"] == pytest.approx(BETA * (1 - GAMMA))
    assert summ["rec_scale"]["libero_10"] == pytest.approx(BETA * (1 - 0.995))
    assert summ["success_margin"]["reward.gamma"] == pytest.approx(
        A.success_margin(BETA, GAMMA, CLIP, T_STORE)
    )
    # rec_advantage_share by hand: the same groups with beta = 0.
    gamma = np.full(4, GAMMA)
    R0 = A.discounted_returns(s.r_task, s.valid, gamma)
    A0 = A.group_advantages(R0, s.valid, np.zeros(4, int))
    adv = res.arrays[0]["advantage"]
    mask = s.valid & (s.valid.sum(axis=0) >= 2)[None, :]
    share = np.abs(adv - A0)[mask].mean() / np.abs(adv)[mask].mean()
    assert summ["rec_advantage_share"] == pytest.approx(share, rel=1e-5)
    assert 0 < summ["rec_advantage_share"] < 1
    res0 = compute_advantages([s], _rcfg(beta=0.0))
    assert res0.summary["rec_advantage_share"] == 0.0
    np.testing.assert_array_equal(res0.arrays[0]["reward"], s.r_task)
    with pytest.raises(ValueError, match="reward.beta"):
        compute_advantages([s], _rcfg(beta=2.0))


# ---- stores ---------------------------------------------------------------------------------

STATE_LOW = np.array([-0.5, -0.4, 0.0, 1.0, -2.0, -1.0, 0.0, -0.04])
STATE_HIGH = np.array([0.5, 0.4, 1.2, 3.5, 2.0, 1.0, 0.04, 0.0])


def _stats() -> dict[str, Any]:
    return {
        "state": {"s": {"min": STATE_LOW.tolist(), "max": STATE_HIGH.tolist()}},
        "action": {"a": {"min": [-1.0] * 7, "max": [1.0] * 7}},
    }


def _write_shard(
    path: Path, policy_dir: Path, T: int, video_frames: int, cfg: dict[str, Any]
) -> np.ndarray:
    """Two episodes (one success with a video) of T steps; returns the raw video proprio."""
    rng = np.random.default_rng(3)
    K = 2
    attrs = {
        "iteration": 1,
        "shard": 0,
        "G": 2,
        "a": 0.5,
        "policy_checkpoint": str(policy_dir),
        "policy_sha256": "0" * 64,
        "config": cfg,
    }
    raw_video_proprio = rng.uniform(STATE_LOW, STATE_HIGH, (video_frames, 8)).astype(np.float32)
    with store.ShardWriter(path, 2, T, K, video_frames, attrs) as w:
        for i in range(2):
            r_task = np.zeros(T, np.float32)
            r_task[-1] = float(i == 0)
            w.write_episode(
                i,
                store.EpisodeData(
                    task=3,
                    init_state=0,
                    group=0,
                    success=i == 0,
                    video_sft=i == 0,
                    env_crashed=False,
                    length=T,
                    image=np.zeros((T, 224, 448, 3), np.uint8),
                    proprio=rng.uniform(-1, 1, (T, 8)).astype(np.float32),  # normalised
                    chain=np.zeros((T, K + 1, 32, 7), np.float32),
                    k_star=np.ones(T, np.int32),
                    logp_old=np.zeros(T, np.float32),
                    frames=np.zeros((T, 2, 224, 448, 3), np.uint8),
                    r_task=r_task,
                    done=np.arange(T) == T - 1,
                    video_frames=np.zeros((video_frames, 224, 448, 3), np.uint8)
                    if i == 0
                    else None,
                    video_proprio=raw_video_proprio if i == 0 else None,
                ),
            )
    return raw_video_proprio


def _cfg() -> dict[str, Any]:
    from wamrl.config import load_config

    return load_config(overrides={"rollout.workers": 1, "rollout.groups": 1})


def test_reward_stage_refuses_large_beta_before_any_work(tmp_path, monkeypatch) -> None:
    import stages.reward
    import wamrl.policy

    cfg = _cfg()
    cfg["reward"]["beta"] = 2.0
    run = tmp_path / "run"
    pdir = paths.policy_dir(run, 0)
    pdir.mkdir(parents=True)
    shard = paths.shard_path(run, 1, 0)
    _write_shard(shard, pdir, T=10, video_frames=1, cfg=cfg)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))

    def no_model(*a: Any, **k: Any) -> None:
        raise AssertionError("the world model was loaded before the reward check")

    monkeypatch.setattr(wamrl.policy, "load_policy", no_model)
    with pytest.raises(ValueError, match=r"reward\.beta=2\.0.*reward\.rec_clip=3\.0.*T=10"):
        stages.reward.main(cfg, run, 1)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    assert "reward" not in zarr.open_group(str(shard), mode="r")
    assert not paths.reward_done(run, 1).exists()
    # The library entry point checks too, before imagining anything.
    from wamrl.reward import run_reward

    with pytest.raises(ValueError, match="reward.beta"):
        run_reward(None, [shard], torch.zeros(1), torch.zeros(1), cfg, {})  # type: ignore[arg-type]


def test_world_model_batches_carry_normalised_proprio(tmp_path) -> None:
    from wamrl import world_model as wm

    cfg = _cfg()
    pdir = tmp_path / "policy"
    pdir.mkdir()
    (pdir / "stats.json").write_text(json.dumps(_stats()))
    shard = tmp_path / "shard_000.zarr"
    raw = _write_shard(shard, pdir, T=2, video_frames=13, cfg=cfg)
    wcfg = {"window_frames": 5, "windows_per_episode": 3}
    specs, counts = wm.list_windows([shard], wcfg)
    assert counts["successful_video_episodes"] == 1 and [s.t0 for s in specs] == [0, 4, 8]
    norm = Normalizer(_stats())
    ctx, mask = torch.zeros(40, 3, 4), torch.ones(40, 3, dtype=torch.bool)
    expected = norm.normalize_state(raw[[0, 4, 8]])
    assert not np.allclose(expected, raw[[0, 4, 8]])  # the test can tell them apart
    for given in (norm, None):  # None: the stats of the store's policy_checkpoint
        b = wm.WindowBatches([shard], specs, 3, ctx, mask, wcfg, 10, normalizer=given)[0]
        np.testing.assert_array_equal(b["proprio"].numpy(), expected)
        assert b["video"].shape[:2] == (3, 2)


def test_world_model_step_proprio_fallback_is_not_renormalised(tmp_path) -> None:
    """A store without video/proprio: step/proprio (stored normalised) is used as is."""
    from wamrl import world_model as wm

    cfg = _cfg()
    shard = tmp_path / "shard_000.zarr"
    _write_shard(shard, tmp_path / "absent_policy", T=2, video_frames=13, cfg=cfg)
    g = zarr.open_group(str(shard), mode="r+")
    del g["video/proprio"]
    step_proprio = np.asarray(g["step/proprio"][0])
    specs = [wm.WindowSpec(0, 0, t0) for t0 in (0, 4, 8)]
    ctx, mask = torch.zeros(40, 3, 4), torch.ones(40, 3, dtype=torch.bool)
    wcfg = {"window_frames": 5, "windows_per_episode": 3}
    # No normaliser and no stats file: the fallback path needs neither.
    b = wm.WindowBatches([shard], specs, 3, ctx, mask, wcfg, 4)[0]
    # t0 // replan_steps = 0, 1, 2, capped at the last step (1).
    np.testing.assert_array_equal(b["proprio"].numpy(), step_proprio[[0, 1, 1]])
