"""Reward normalisation, returns, group advantages and filtering against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from wamrl import advantages as A


def test_normalise_rec_over_valid_only() -> None:
    r = np.array([[1.0, 3.0, 99.0], [5.0, 7.0, -50.0]], dtype=np.float32)
    valid = np.array([[True, True, False], [True, True, False]])
    out, mean, std = A.normalise_rec(r, valid)
    vals = np.array([1.0, 3.0, 5.0, 7.0])
    assert mean == pytest.approx(vals.mean())
    assert std == pytest.approx(vals.std())  # population std
    np.testing.assert_allclose(out[valid], (vals - vals.mean()) / vals.std(), rtol=1e-6)
    assert (out[~valid] == 0).all()


def test_normalise_rec_constant_gives_zero() -> None:
    out, mean, std = A.normalise_rec(np.full((2, 2), -0.3), np.ones((2, 2), bool))
    assert std == pytest.approx(0.0, abs=1e-12)
    assert np.allclose(out, 0.0)


def test_combine() -> None:
    # r = r_task + beta * (1 - gamma) * clip(z, -c, c): 0.1 * 0.01 * {2, -1}
    np.testing.assert_allclose(
        A.combine(np.array([0.0, 1.0]), np.array([2.0, -1.0]), 0.1, 0.99, 3.0),
        [0.1 * 0.01 * 2.0, 1.0 - 0.1 * 0.01],
        rtol=1e-6,
    )


def test_discounted_returns_by_hand() -> None:
    reward = np.array([[0.1, 0.2, 1.0, 5.0], [0.5, -0.5, 9.0, 9.0]], dtype=np.float32)
    valid = np.array([[True, True, True, False], [True, True, False, False]])
    gamma = np.array([0.9, 0.5])
    R = A.discounted_returns(reward, valid, gamma)
    expected0 = [0.1 + 0.9 * 0.2 + 0.81 * 1.0, 0.2 + 0.9 * 1.0, 1.0, 0.0]
    expected1 = [0.5 + 0.5 * -0.5, -0.5, 0.0, 0.0]  # padding rewards (9.0) are ignored
    np.testing.assert_allclose(R[0], expected0, rtol=1e-6)
    np.testing.assert_allclose(R[1], expected1, rtol=1e-6)


def test_episode_gammas_suite() -> None:
    g = A.episode_gammas(np.array([0, 29, 30, 39]), 0.99, 0.995)
    np.testing.assert_allclose(g, [0.99, 0.99, 0.995, 0.995])


def test_group_advantages_zero_mean_unit_std_over_live_members() -> None:
    rng = np.random.default_rng(0)
    E, T = 7, 6
    returns = rng.normal(size=(E, T)).astype(np.float32)
    lengths = np.array([6, 3, 5, 6, 1, 4, 2])
    valid = np.arange(T)[None, :] < lengths[:, None]
    group = np.array([0, 0, 0, 0, 1, 1, 1])
    adv = A.group_advantages(returns, valid, group, eps=0.0)
    for g in (0, 1):
        for t in range(T):
            live = (group == g) & valid[:, t]
            a = adv[live, t]
            if live.sum() >= 2:
                assert a.mean() == pytest.approx(0.0, abs=1e-5)
                assert a.std() == pytest.approx(1.0, abs=1e-5)  # population std
                R = returns[live, t].astype(np.float64)
                np.testing.assert_allclose(a, (R - R.mean()) / R.std(), rtol=1e-5)
            else:
                assert np.all(a == 0.0)  # a lone survivor has nothing to compare with
    assert (adv[~valid] == 0).all()


def test_group_advantages_episode_scale_is_the_whole_episode_spread() -> None:
    """scale="episode": the same per-step mean, divided by each group's std of R_0."""
    rng = np.random.default_rng(3)
    E, T = 7, 6
    returns = rng.normal(size=(E, T)).astype(np.float32)
    lengths = np.array([6, 3, 5, 6, 1, 4, 2])
    valid = np.arange(T)[None, :] < lengths[:, None]
    group = np.array([0, 0, 0, 0, 1, 1, 1])
    adv = A.group_advantages(returns, valid, group, eps=0.0, scale="episode")
    step = A.group_advantages(returns, valid, group, eps=0.0)
    for g in (0, 1):
        s0 = returns[group == g, 0].astype(np.float64).std()
        for t in range(T):
            live = (group == g) & valid[:, t]
            if live.sum() < 2:
                assert np.all(adv[live, t] == 0.0)
                continue
            R = returns[live, t].astype(np.float64)
            np.testing.assert_allclose(adv[live, t], (R - R.mean()) / s0, rtol=1e-5)
            # The same ranking and signs as scale="step": only the size differs.
            assert (np.sign(adv[live, t]) == np.sign(step[live, t])).all()
    assert (adv[~valid] == 0).all()
    with pytest.raises(ValueError, match="reward.adv_scale"):
        A.group_advantages(returns, valid, group, scale="batch")  # type: ignore[arg-type]


def test_group_advantages_eps_and_two_members() -> None:
    returns = np.array([[1.0], [3.0]])
    adv = A.group_advantages(returns, np.ones((2, 1), bool), np.array([5, 5]), eps=1e-6)
    np.testing.assert_allclose(adv[:, 0], [-1.0 / (1.0 + 1e-6), 1.0 / (1.0 + 1e-6)], rtol=1e-6)


def _filter_fixture() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # group 0: mixed outcomes; group 1: all succeeded but returns differ (rec term);
    # group 2: all failed, identical returns; group 3: single episode.
    success = np.array([True, False, True, True, False, False, True])
    group = np.array([0, 0, 1, 1, 2, 2, 3])
    returns = np.array(
        [[1.0, 0.5], [0.1, 0.0], [0.9, 1.0], [1.1, 1.0], [0.2, 0.2], [0.2, 0.2], [1.0, 1.0]]
    )
    valid = np.ones((7, 2), bool)
    return success, returns, valid, group


def test_filter_all_same() -> None:
    success, returns, valid, group = _filter_fixture()
    kept = A.degenerate_groups(success, returns, valid, group, "all_same")
    np.testing.assert_array_equal(kept, [True, True, False, False, False, False, False])


def test_filter_zero_spread() -> None:
    success, returns, valid, group = _filter_fixture()
    kept = A.degenerate_groups(success, returns, valid, group, "zero_spread", eps=1e-6)
    np.testing.assert_array_equal(kept, [True, True, True, True, False, False, False])


def test_filter_none_and_bad_mode() -> None:
    success, returns, valid, group = _filter_fixture()
    assert A.degenerate_groups(success, returns, valid, group, "none").all()
    with pytest.raises(ValueError, match="unknown"):
        A.degenerate_groups(success, returns, valid, group, "bogus")  # type: ignore[arg-type]


def test_compute_advantages_joins_a_group_split_over_shards() -> None:
    from wamrl.reward import ShardRewardInputs, compute_advantages

    rng = np.random.default_rng(1)

    def shard(group, task, success, lengths, T, crashed=None):
        E = len(group)
        valid = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
        r_task = np.zeros((E, T), np.float32)
        for i, (s, n) in enumerate(zip(success, lengths, strict=True)):
            if s:
                r_task[i, n - 1] = 1.0
        return ShardRewardInputs(
            valid=valid,
            r_task=r_task,
            task=np.asarray(task),
            group=np.asarray(group),
            init_state=np.zeros(E, np.int64),
            success=np.asarray(success),
            crashed=np.zeros(E, bool) if crashed is None else np.asarray(crashed),
            r_rec=np.where(valid, rng.normal(size=(E, T)), 0.0).astype(np.float32),
        )

    # Group 0 (task 3) is split: two episodes in each shard; group 1 (task 35) all failed.
    s0 = shard([0, 0, 1], [3, 3, 35], [True, False, False], [2, 3, 3], T=3)
    s1 = shard(
        [0, 0, 1], [3, 3, 35], [False, True, False], [3, 1, 2], T=4, crashed=[False, False, True]
    )
    cfg = {
        "beta": 0.1,
        "gamma": 0.99,
        "gamma_libero_10": 0.995,
        "rec_clip": 3.0,
        "filter": "all_same",
        "zero_spread_eps": 1e-6,
        "adv_scale": "step",
    }
    res = compute_advantages([s0, s1], cfg)

    valid = np.concatenate([np.pad(s0.valid, ((0, 0), (0, 1))), s1.valid])
    r_rec = np.concatenate([np.pad(s0.r_rec, ((0, 0), (0, 1))), s1.r_rec])
    vals = r_rec[valid]
    assert res.summary["rec_mean"] == pytest.approx(vals.mean(), rel=1e-6)
    assert res.summary["rec_std"] == pytest.approx(vals.std(), rel=1e-6)
    # Group 0's four members are compared together across the two shards.
    R = np.concatenate([np.pad(res.arrays[0]["return"], ((0, 0), (0, 1))), res.arrays[1]["return"]])
    adv = np.concatenate(
        [np.pad(res.arrays[0]["advantage"], ((0, 0), (0, 1))), res.arrays[1]["advantage"]]
    )
    members = np.array([0, 1, 3, 4])
    live = valid[members, 0]
    Rt = R[members, 0][live].astype(np.float64)
    np.testing.assert_allclose(
        adv[members, 0][live], (Rt - Rt.mean()) / (Rt.std() + 1e-6), rtol=1e-5
    )
    # libero_10 episode: gamma 0.995 in its return.
    rw = res.arrays[0]["reward"][2]
    assert res.arrays[0]["return"][2, 0] == pytest.approx(
        rw[0] + 0.995 * rw[1] + 0.995**2 * rw[2], rel=1e-5
    )
    # Filtering: group 0 mixed -> kept; group 1 all failed -> dropped; the crashed one has A = 0.
    np.testing.assert_array_equal(res.group_kept[0], [True, True, False])
    np.testing.assert_array_equal(res.group_kept[1], [True, True, False])
    assert (res.arrays[1]["advantage"][2] == 0).all()
    assert res.summary["groups_kept"] == 1 and res.summary["groups_total"] == 2
