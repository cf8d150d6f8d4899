"""The data-parallel learner (actor.devices > 1) gives the one-process update.

actor_update runs once in this process and once in 2 gloo processes (wamrl.distributed's
launcher, as stages/actor.py uses it) on the same tiny policy, synthetic data, seed and
config; the weights (on both ranks), the per-step KL trace, the early stop and the epochs'
metrics must agree within float rounding. The minibatches are sized so that the ranks'
shares are unequal and one minibatch leaves rank 1 with nothing. The same launch also runs
the actor stage's rank body (rank 0 writes actor/), compared with a one-process stage run.
All of it is one launch: each rank's Python + torch start costs seconds.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import ONE_LAYER_TINY, default_cfg, make_tiny_policy
from wamrl import distributed, ppo, training
from wamrl.master import MasterWeightOptimizer

N = 9  # kept steps: minibatches of 4, 4, 1 (the last one leaves rank 1 empty)
RTOL, ATOL = 1e-5, 1e-6  # the weights
KL_ATOL = 5e-6  # the KLs (0.005 to 0.8 here): sums of squares of small differences of mu
# The epochs' means (grad_norm above all: |g| ~ 50 here, clipped to 0.5) move by up to
# ~6e-5 relative with the summation order alone: computing the same minibatches with
# micro_batch 1 instead of 4 in one process does that.
METRIC_RTOL = 2e-4
# Adam's eps: a key bias of softmax attention has a gradient of exactly zero in exact
# arithmetic (it shifts every logit alike), so its float gradient is rounding noise, which
# Adam scales up to ~0.1 lr per step at eps 1e-8 in any two summation orders. eps 1e-6
# leaves the real gradients' (|g| >> 1e-6) steps as they are and that noise ~1e-3 lr.
EPS = 1e-6


def _cfg(**actor: Any) -> dict[str, Any]:
    cfg = default_cfg()
    # Synthetic chains: the ratio's denominator is the learner's own log pi (ratio 1 at
    # first). grad_clip 0.5 so that clipping acts on the all-reduced gradient.
    cfg["actor"].update(
        epochs=2,
        minibatch=4,
        micro_batch=1,
        lr=1e-4,
        grad_clip=0.5,
        logp_old="recompute",
        target_kl=None,
        ref_kl=0.1,
    )
    cfg["actor"].update(actor)
    return cfg


@functools.cache
def _data(n: int = N) -> ppo.ActorData:
    """Random observations and x_k; x_{k*+1} drawn from the initial policy's SDE step, as
    a rollout would (a random one lies far out in the Gaussian, where log pi and its
    gradient are huge and every float rounding of the weights shows in the loss)."""
    rng = np.random.default_rng(0)
    data = ppo.ActorData(
        image=rng.integers(0, 256, (n, 224, 448, 3), dtype=np.uint8),
        proprio=rng.uniform(-1, 1, (n, 8)).astype(np.float32),
        task=rng.integers(0, 2, n),
        x_k=rng.standard_normal((n, 32, 7)).astype(np.float32),
        x_next=rng.standard_normal((n, 32, 7)).astype(np.float32),
        k_star=rng.integers(1, 4, n),
        logp_old=np.zeros(n, np.float32),
        adv=rng.standard_normal(n).astype(np.float32),
        where=np.zeros((n, 3), np.int64),
        context=torch.randn(2, 4, 384, generator=torch.Generator().manual_seed(0)),
        context_mask=torch.ones(2, 4, dtype=torch.bool),
        K=4,
        noise_a=0.5,
        shift=5.0,
    )
    lp = ppo.learner_pass(make_tiny_policy(config=ONE_LAYER_TINY), data, n, "cpu")
    eps = rng.standard_normal(data.x_k.shape).astype(np.float32)
    data.x_next = lp.mu + lp.std[:, None, None] * eps
    return data


def _update(cfg: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """actor_update on a fresh tiny policy (with iteration 0's copy as the reference),
    through the stage's optimizer wrapper; in whatever process group is current."""
    policy = make_tiny_policy(config=ONE_LAYER_TINY)
    ref = copy.deepcopy(policy)
    params = policy.parameter_groups()["actor"]
    ids = {id(p) for p in params}
    for p in policy.parameters():
        p.requires_grad_(id(p) in ids)
    lr = float(cfg["actor"]["lr"])
    opt = MasterWeightOptimizer(params, lambda ps: torch.optim.Adam(ps, lr=lr, eps=EPS))
    metrics = ppo.actor_update(policy, ref, _data(), cfg, opt, seed=7)
    names = training.param_names(policy, params)
    state = policy.state_dict()
    return {n: state[n].detach().clone().contiguous() for n in names}, metrics


def _stage_cfg() -> dict[str, Any]:
    # Adam's default eps here (as the stage builds it): lr 1e-6 keeps the key bias's noise
    # steps (~0.1 lr each, see EPS) under the weights' tolerance.
    return _cfg(lr=1e-6, epochs=1, devices=2)


def _patch_stage_inputs(setattr_: Any) -> None:
    """The actor stage's inputs from this module instead of a run's files."""
    import stages.actor
    import wamrl.policy
    import wamrl.policy.text

    data = _data()
    setattr_(wamrl.policy, "load_policy", lambda *a, **k: make_tiny_policy(config=ONE_LAYER_TINY))
    setattr_(wamrl.policy.text, "load_contexts", lambda *a: (data.context, data.context_mask))
    setattr_(stages.actor, "load_actor_data", lambda *a: data)


def _write_reward_done(run: Path) -> None:
    from wamrl import paths

    done = paths.reward_done(run, 1)
    done.parent.mkdir(parents=True, exist_ok=True)
    # the config the reward stage records: the actor checks its reward keys against its own
    done.write_text(json.dumps({"groups_kept": 1, "groups_total": 1, "config": _stage_cfg()}))


def _rank_updates(
    rank: int, device: torch.device, cfgs: list[dict], out: str, stage_run: str
) -> None:
    assert distributed.world_size() == 2 and distributed.rank() == rank
    assert device == torch.device("cpu")
    for i, cfg in enumerate(cfgs):
        weights, metrics = _update(cfg)
        save_file(weights, str(Path(out) / f"case{i}_rank{rank}.safetensors"))
        (Path(out) / f"case{i}_rank{rank}.json").write_text(json.dumps(metrics))
    # The actor stage's rank body, as stages.actor.main launches it for actor.devices 2.
    import stages.actor

    _patch_stage_inputs(setattr)  # a spawned process: nothing to undo
    stages.actor._rank_main(rank, device, _stage_cfg(), Path(stage_run), 1)


def _ddp(
    cfgs: list[dict], out: Path, stage_run: Path
) -> list[list[tuple[dict[str, torch.Tensor], dict]]]:
    """Every config's update in one launch of 2 gloo ranks: [case][rank] -> (weights, metrics)."""
    distributed.launch(_rank_updates, [torch.device("cpu")] * 2, cfgs, str(out), str(stage_run))
    return [
        [
            (
                load_file(out / f"case{i}_rank{r}.safetensors"),
                json.loads((out / f"case{i}_rank{r}.json").read_text()),
            )
            for r in range(2)
        ]
        for i in range(len(cfgs))
    ]


def _assert_same(
    single: tuple[dict[str, torch.Tensor], dict[str, Any]],
    ranks: list[tuple[dict[str, torch.Tensor], dict]],
) -> None:
    w1, m1 = single
    m1 = json.loads(json.dumps(m1))  # as the ranks' went through JSON
    for r, (w, m) in enumerate(ranks):
        assert set(w) == set(w1)
        for n in w1:
            torch.testing.assert_close(w[n], w1[n], rtol=RTOL, atol=ATOL, msg=f"rank {r}: {n}")
        np.testing.assert_allclose(m["kl_trace"], m1["kl_trace"], rtol=RTOL, atol=KL_ATOL)
        assert (m["early_stop"] is None) == (m1["early_stop"] is None)
        if m1["early_stop"] is not None:
            for k in ("epoch", "minibatch", "optimizer_steps"):
                assert m["early_stop"][k] == m1["early_stop"][k]
            assert m["early_stop"]["kl"] == pytest.approx(m1["early_stop"]["kl"], rel=RTOL)
        assert len(m["epochs"]) == len(m1["epochs"])
        for e, e1 in zip(m["epochs"], m1["epochs"], strict=True):
            assert list(e) == list(e1)  # the same keys, in the same order
            for k in e1:
                assert e[k] == pytest.approx(e1[k], rel=METRIC_RTOL, abs=KL_ATOL), (r, k)
        for k in ("kl", "actor_params_without_grad", "steps"):
            assert m[k] == pytest.approx(m1[k], rel=RTOL, abs=KL_ATOL), k
        for k, v in m1["kl_by_k_star"].items():
            assert m["kl_by_k_star"][k] == pytest.approx(v, rel=RTOL, abs=KL_ATOL)
    # Every rank took the identical steps: their weights agree bit for bit.
    for n in w1:
        assert torch.equal(ranks[0][0][n], ranks[1][0][n]), n


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both configs run single-process here and in one 2-rank launch (a launch costs each
    rank a Python + torch start)."""
    plain = _cfg()
    # Minibatches of 3 (shares 2 + 1), micro_batch 2: rank 0's share in one part of 2.
    stop = _cfg(micro_batch=2, ref_kl=0.0, minibatch=3)
    trace = _update(stop)[1]["kl_trace"]
    # Stop before step k: a threshold between the KL there and every earlier one.
    k = next(k for k in range(2, len(trace)) if trace[k] > 1.5 * max(trace[:k]))
    stop["actor"]["target_kl"] = (trace[k] + max(trace[:k])) / 2
    stage_run = tmp_path_factory.mktemp("stage_ddp")
    _write_reward_done(stage_run)
    ddp = _ddp([plain, stop], tmp_path_factory.mktemp("ddp"), stage_run)
    return {
        "plain": (_update(plain), ddp[0]),
        "stop": (_update(stop), ddp[1], k),
        "stage_run": stage_run,
    }


def test_two_gloo_ranks_give_the_single_process_update(cases: dict[str, Any]) -> None:
    single, ranks = cases["plain"]
    assert single[1]["early_stop"] is None
    steps = len(single[1]["kl_trace"])
    assert steps == 2 * 3 and single[1]["kl"] > 0  # 2 epochs of minibatches 4, 4, 1
    assert single[1]["epochs"][0]["ref_kl"] > 0
    _assert_same(single, ranks)


def test_target_kl_stops_every_rank_at_the_single_process_step(cases: dict[str, Any]) -> None:
    single, ranks, k = cases["stop"]
    assert single[1]["early_stop"] is not None
    assert single[1]["early_stop"]["optimizer_steps"] == k
    assert len(single[1]["kl_trace"]) == k + 1
    _assert_same(single, ranks)


def test_actor_stage_with_two_devices_writes_the_single_process_outputs(
    cases: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stages.actor
    from wamrl import paths

    cfg = _stage_cfg()
    cfg["actor"]["devices"] = 1
    _patch_stage_inputs(monkeypatch.setattr)
    _write_reward_done(tmp_path)
    stages.actor.main(cfg, tmp_path, 1)
    one, two = paths.actor_dir(tmp_path, 1), paths.actor_dir(cases["stage_run"], 1)
    assert sorted(f.name for f in two.iterdir()) == sorted(f.name for f in one.iterdir())
    for name in ("actor.safetensors", "optimizer.safetensors"):
        a, b = load_file(one / name), load_file(two / name)
        assert set(a) == set(b) and a
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=RTOL, atol=ATOL, msg=f"{name}: {k}")
    m1 = json.loads((one / "metrics.json").read_text())
    m2 = json.loads((two / "metrics.json").read_text())
    assert m1["devices"] == 1 and m2["devices"] == 2
    assert m2["config"]["actor"]["devices"] == 2
    np.testing.assert_allclose(m2["kl_trace"], m1["kl_trace"], rtol=RTOL, atol=KL_ATOL)


def test_pick_devices_takes_distinct_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from wamrl import runtime

    assert distributed.pick_devices({"device": "cpu"}, 2) == [torch.device("cpu")] * 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("WAMRL_GPU", "1")
    assert distributed.pick_devices({"device": "cuda"}, 2) == [
        torch.device("cuda:1"),
        torch.device("cuda:2"),
    ]
    with pytest.raises(RuntimeError, match="learner devices"):
        distributed.pick_devices({"device": "cuda"}, 4)
    # No WAMRL_GPU: a slot lock per rank, held while the ranks run; another job has GPU 0.
    monkeypatch.delenv("WAMRL_GPU")
    monkeypatch.setattr(runtime, "gpu_slot_dir", lambda: tmp_path)
    monkeypatch.setattr(distributed, "_SLOT_LOCKS", [])
    held = runtime.acquire_gpu_slot(4, tmp_path)
    assert held[0] == 0
    assert distributed.pick_devices({"device": "cuda"}, 2) == [
        torch.device("cuda:1"),
        torch.device("cuda:2"),
    ]
    other = runtime.acquire_gpu_slot(4, tmp_path)
    assert other[0] == 3  # 1 and 2 stay taken
    for _, f in [held, other, *distributed._SLOT_LOCKS]:
        f.close()
