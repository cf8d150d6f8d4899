"""The learner stages on the real tiny backend and a small synthetic store.

The store is written with store.ShardWriter from chains sampled with the iteration-0
policy (so log pi_old is the sampler's own), random images and random "rendered" frames.
Then reward -> actor -> world_model -> merge run exactly as the Snakemake rules call them.
The run up to the reward stage is the run_after_reward fixture (tests/conftest.py, built by
tests/helpers.py's make_run), which other test files share.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from safetensors.torch import load_file

from tests.helpers import VIDEO_FRAMES
from wamrl import paths, ppo, store, training
from wamrl import world_model as wm
from wamrl.atomic import sha256_file

sampler = pytest.importorskip("wamrl.sampler")
policy_pkg = pytest.importorskip("wamrl.policy")
text = pytest.importorskip("wamrl.policy.text")


def _reward_arrays(run: Path) -> dict[str, np.ndarray]:
    out = {}
    for w in range(2):
        g = zarr.open_group(str(paths.shard_path(run, 1, w)), mode="r")
        for name in (*store.REWARD_NAMES, "group_kept"):
            out[f"{w}/{name}"] = np.asarray(g[f"reward/{name}"][:])
    return out


def test_reward_stage_rerun_is_identical(run_after_reward) -> None:
    import stages.reward

    run, cfg = run_after_reward
    first = _reward_arrays(run)
    done = json.loads(paths.reward_done(run, 1).read_text())
    assert done["groups_total"] == 1 and done["groups_kept"] == 1  # mixed successes
    assert np.isfinite(first["0/r_rec"]).all() and (first["0/r_rec"] <= 0).all()
    stages.reward.main(cfg, run, 1)
    second = _reward_arrays(run)
    for k in first:
        np.testing.assert_array_equal(first[k], second[k], err_msg=k)


def _data(run: Path, cfg: dict[str, Any]) -> tuple[Any, ppo.ActorData]:
    pdir = paths.policy_dir(run, 0)
    policy = policy_pkg.load_policy(pdir)
    context, mask = text.load_contexts(pdir / "context.safetensors")
    data = ppo.load_actor_data(paths.shard_paths(run, 1, 2), context, mask, cfg)
    return policy, data


def test_logp_check_passes_then_fails_after_perturbation(run_after_reward) -> None:
    run, cfg = run_after_reward
    policy, data = _data(run, cfg)
    stats = ppo.check_logp(policy, data, cfg["actor"]["logp_check_tol"], 8, "cpu")
    assert stats["logp_check_max_ratio_dev"] <= cfg["actor"]["logp_check_tol"]
    bad = copy.copy(data)
    bad.logp_old = data.logp_old.copy()
    bad.logp_old[1] += 0.05
    s, e, t = data.where[1]
    with pytest.raises(ppo.LogProbMismatchError, match=f"shard {s}, episode {e}, step {t}"):
        ppo.check_logp(policy, bad, cfg["actor"]["logp_check_tol"], 8, "cpu")


def test_recompute_takes_the_learners_log_pi_as_old(run_after_reward) -> None:
    """actor.logp_old: recompute — a rollout log pi_old that is off (as a bf16 rollout's is)
    stops the default mode, while recompute trains from ratio 1 and reports the gap."""
    run, cfg = run_after_reward
    policy, data = _data(run, cfg)
    off = copy.copy(data)
    shift = np.random.default_rng(0).uniform(-0.3, 0.3, len(data))
    off.logp_old = (data.logp_old + shift).astype(np.float32)
    cfg = copy.deepcopy(cfg)
    cfg["actor"].update(lr=1e-4, epochs=1)
    opt = torch.optim.Adam(policy.parameter_groups()["actor"], lr=1e-4)
    with pytest.raises(ppo.LogProbMismatchError):
        ppo.actor_update(policy, None, off, cfg, opt)
    cfg["actor"]["logp_old"] = "recompute"
    metrics = ppo.actor_update(policy, None, off, cfg, opt)
    check = metrics["logp_check"]
    assert check["logp_check_max_abs_delta"] == pytest.approx(np.abs(shift).max(), abs=1e-3)
    assert check["logp_check_mean_abs_delta"] == pytest.approx(np.abs(shift).mean(), abs=1e-3)
    # fp32 on unchanged weights: the first minibatch's ratio is 1 to float precision.
    assert metrics["epochs"][0]["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5)


def test_actor_update_follows_advantage_sign(run_after_reward) -> None:
    run, cfg = run_after_reward
    policy, data = _data(run, cfg)
    assert (data.adv > 0).any() and (data.adv < 0).any()
    cfg = copy.deepcopy(cfg)
    # A step inside the trust region: at lr 1e-4 log pi moved by up to 9 nats here (ratio
    # e^9), where the sign of the change no longer follows the first-order gradient.
    cfg["actor"]["lr"] = 2e-5
    params = policy.parameter_groups()["actor"]
    idx = np.arange(len(data))
    with torch.no_grad():
        before = ppo._log_prob(policy, data, idx, "cpu")
    opt = torch.optim.Adam(params, lr=cfg["actor"]["lr"])
    metrics = ppo.actor_update(policy, None, data, cfg, opt)
    with torch.no_grad():
        after = ppo._log_prob(policy, data, idx, "cpu")
    delta = (after - before).numpy()
    assert float((data.adv * delta).sum()) > 0  # the surrogate rose
    assert delta[data.adv > 0].mean() > 0, delta
    assert delta[data.adv < 0].mean() < 0, delta
    assert metrics["epochs"][0]["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-3)
    assert len(metrics["epochs"]) == cfg["actor"]["epochs"]


def test_bf16_actor_path_matches_float32_within_tolerance(run_after_reward) -> None:
    """actor.amp: bf16 autocasts the model; log pi stays float32 and close to the fp32 path."""
    run, cfg = run_after_reward
    policy, data = _data(run, cfg)
    idx = np.arange(len(data))
    with torch.no_grad():
        fp32 = ppo._log_prob(policy, data, idx, "cpu")
        bf16 = ppo._log_prob(policy, data, idx, "cpu", amp=torch.bfloat16)
    assert bf16.dtype == torch.float32
    # bf16 rounding moves mu by ~1e-3 of the velocity; log pi sums 224 Gaussian terms.
    assert (bf16 - fp32).abs().max() < 0.5, (bf16 - fp32).abs().max()
    assert not torch.equal(bf16, fp32)  # autocast did act
    cfg = copy.deepcopy(cfg)
    # lr 2e-5: a step inside the trust region (see test_actor_update_follows_advantage_sign).
    cfg["actor"].update(lr=2e-5, amp="bf16", logp_old="recompute")
    opt = torch.optim.Adam(policy.parameter_groups()["actor"], lr=2e-5)
    metrics = ppo.actor_update(policy, None, data, cfg, opt)
    # The gap to the rollout's fp32 log pi is reported; the ratio starts at 1 regardless.
    gap = metrics["logp_check"]["logp_check_max_abs_delta"]
    assert gap == pytest.approx(float((bf16 - fp32).abs().max()), rel=0.5), gap
    assert metrics["epochs"][0]["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-2)
    with torch.no_grad():
        after = ppo._log_prob(policy, data, idx, "cpu")
    delta = (after - fp32).numpy()
    assert delta[data.adv > 0].mean() > 0 and delta[data.adv < 0].mean() < 0, delta
    assert float((data.adv * delta).sum()) > 0  # the surrogate rose


def test_nan_stops_actor_stage_before_writing(run_after_reward, monkeypatch) -> None:
    import stages.actor

    run, cfg = run_after_reward
    real = ppo.ppo_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(ppo, "ppo_loss", nan_loss)
    with pytest.raises(training.NonFiniteError):
        stages.actor.main(cfg, run, 1)
    assert not paths.actor_dir(run, 1).exists()


def test_actor_world_model_merge_stages(run_after_reward) -> None:
    import stages.actor
    import stages.merge
    import stages.world_model

    run, cfg = run_after_reward
    stages.actor.main(cfg, run, 1)
    stages.world_model.main(cfg, run, 1)
    stages.merge.main(cfg, run, 1)
    actor = load_file(str(paths.actor_dir(run, 1) / "actor.safetensors"))
    lora = load_file(str(paths.world_model_dir(run, 1) / "lora.safetensors"))
    wmm = json.loads((paths.world_model_dir(run, 1) / "metrics.json").read_text())
    assert wmm["windows"] == 4 and wmm["kl_first_batch"] == pytest.approx(0.0, abs=1e-7)
    merged = policy_pkg.load_policy(paths.policy_dir(run, 1)).state_dict()
    for name, t in {**actor, **lora}.items():
        torch.testing.assert_close(merged[name], t)
    ck = json.loads((paths.policy_dir(run, 1) / "checkpoint.json").read_text())
    assert ck["sha256"] == sha256_file(paths.policy_dir(run, 1) / "model.safetensors")
    assert ck["iteration"] == 1 and set(ck["parents"]) == {"policy", "actor", "world_model"}
    opt = load_file(str(paths.actor_dir(run, 1) / "optimizer.safetensors"))
    # Adam state exists for every actor tensor that received a gradient (a tensor used only
    # inside the no_grad first-frame cache gets none), and only for actor tensors.
    with_state = {k.rsplit(".", 1)[0] for k in opt if k.endswith(".exp_avg")}
    assert with_state and with_state <= set(actor)
    am = json.loads((paths.actor_dir(run, 1) / "metrics.json").read_text())
    assert len(with_state) == len(actor) - am["actor_params_without_grad"]


def _window_batch(run: Path, cfg: dict[str, Any], context, mask) -> dict[str, torch.Tensor]:
    shards = paths.shard_paths(run, 1, 2)
    specs, counts = wm.list_windows(shards, cfg["world_model"])
    assert counts["successful_video_episodes"] == 2 and len(specs) == 4
    assert [s.t0 for s in specs[:2]] == wm.window_starts(VIDEO_FRAMES, 33, 2) == [0, 4]
    batches = wm.WindowBatches(
        shards, specs, 2, context, mask, cfg["world_model"], cfg["env"]["replan_steps"]
    )
    b = batches[0]
    assert b["video"].shape[:2] == (2, 9)
    return b


def test_world_model_update_lowers_video_loss_and_kl_starts_at_zero(run_after_reward) -> None:
    run, cfg = run_after_reward
    pdir = paths.policy_dir(run, 0)
    policy = policy_pkg.load_policy(pdir)
    frozen = policy_pkg.load_policy(pdir)
    context, mask = text.load_contexts(pdir / "context.safetensors")
    b = _window_batch(run, cfg, context, mask)

    def vloss() -> float:
        with torch.no_grad():
            g = torch.Generator().manual_seed(123)
            return float(
                policy.video_loss(
                    b["video"], b["context"], b["context_mask"], b["proprio"], generator=g
                )
            )

    cfg = copy.deepcopy(cfg)
    cfg["world_model"]["lr"] = 1e-3
    cfg["world_model"]["epochs"] = 5
    cfg["world_model"]["kl_weight"] = 0.0  # the video loss alone must go down on its batch
    before = vloss()
    metrics, sigma_ref, sigma_theta = wm.world_model_update(policy, frozen, [b], cfg, None, None)
    assert metrics["kl_first_batch"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["per_batch"][-1]["kl"] > 0  # LoRA moved away from the frozen model
    assert vloss() < before
    assert sigma_ref is not None and sigma_theta is not None and (sigma_ref > 0).all()


def test_world_model_epochs_zero_leaves_lora_unchanged(run_after_reward) -> None:
    """world_model.epochs: 0 (the no-update ablation) skips the update instead of failing."""
    run, cfg = run_after_reward
    pdir = paths.policy_dir(run, 0)
    policy = policy_pkg.load_policy(pdir)
    context, mask = text.load_contexts(pdir / "context.safetensors")
    b = _window_batch(run, cfg, context, mask)
    cfg = copy.deepcopy(cfg)
    cfg["world_model"]["epochs"] = 0
    before = {n: v.clone() for n, v in policy.state_dict().items()}
    metrics, sigma_ref, sigma_theta = wm.world_model_update(policy, policy, [b], cfg, None, None)
    assert "epochs is 0" in metrics["skipped"] and sigma_ref is None and sigma_theta is None
    for n, v in policy.state_dict().items():
        assert torch.equal(v, before[n]), n


def test_diag_gauss_kl_matches_formula() -> None:
    z, zr = torch.tensor([[0.5, -1.0]]), torch.tensor([[0.0, 0.0]])
    v, vr = torch.tensor([2.0, 0.5]), torch.tensor([1.0, 1.0])
    per_dim = [
        0.5 * (math.log(1 / 2.0) + (2.0 + 0.25) / 1 - 1),
        0.5 * (math.log(1 / 0.5) + (0.5 + 1.0) - 1),
    ]
    assert float(wm.diag_gauss_kl(z, v, zr, vr)) == pytest.approx(sum(per_dim) / 2, rel=1e-6)
    assert float(wm.diag_gauss_kl(zr, vr, zr, vr)) == 0.0


def test_micro_batches_give_the_same_update(run_after_reward) -> None:
    """actor.micro_batch: a minibatch computed in parts (gradients accumulated) is the same
    update and the same metrics as the whole minibatch at once. SGD, so that the update is
    the gradient itself (Adam's first step is ~lr * sign(g): noise-level gradients flip)."""
    run, cfg = run_after_reward
    cfg = copy.deepcopy(cfg)
    cfg["actor"].update(minibatch=8, epochs=1)
    results = []
    for micro in (None, 3):
        cfg["actor"]["micro_batch"] = micro
        policy, data = _data(run, cfg)
        before = {n: v.clone() for n, v in policy.state_dict().items()}
        opt = torch.optim.SGD(policy.parameter_groups()["actor"], lr=1e-2)
        metrics = ppo.actor_update(policy, None, data, cfg, opt)
        results.append((policy.state_dict(), metrics["epochs"][0]))
    (whole, m_whole), (parts, m_parts) = results
    assert len(data) > 8 and len(data) % 8 != 0  # several minibatches, the last one ragged
    moved = max(float((v - before[n]).abs().max()) for n, v in whole.items())
    assert moved > 1e-4, moved
    for name, value in whole.items():
        torch.testing.assert_close(parts[name], value, rtol=1e-5, atol=1e-7, msg=name)
    for key in ("loss", "grad_norm", "clip_fraction", "approx_kl", "ratio_mean"):
        assert m_parts[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-7), key


def _adam_steps(opt: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far (Adam counts them per parameter)."""
    states = [st for st in opt.state.values() if "step" in st]
    return int(states[0]["step"]) if states else 0


def test_target_kl_stops_the_update_where_the_kl_passes_it(run_after_reward) -> None:
    """actor.target_kl: every optimizer step is taken at a KL <= target; the first minibatch
    whose exact KL from pi_old exceeds it ends the update, its step not taken."""
    run, cfg = run_after_reward
    cfg = copy.deepcopy(cfg)
    cfg["actor"].update(lr=1e-3, minibatch=2, epochs=3)
    runs = {}
    for target in (None, 0.02):
        cfg["actor"]["target_kl"] = target
        policy, data = _data(run, cfg)
        opt = torch.optim.Adam(policy.parameter_groups()["actor"], lr=1e-3)
        steps_before = _adam_steps(opt)
        metrics = ppo.actor_update(policy, None, data, cfg, opt)
        runs[target] = (metrics, _adam_steps(opt) - steps_before)
    full, n_full = runs[None]
    per_epoch = math.ceil(len(data) / 2)
    assert full["early_stop"] is None and n_full == 3 * per_epoch
    assert full["kl"] > 0.02  # unconstrained, the update goes past the target
    stopped, n_stopped = runs[0.02]
    trace = stopped["kl_trace"]
    assert stopped["early_stop"] is not None and n_stopped < n_full
    assert n_stopped == len(trace) - 1 == stopped["early_stop"]["optimizer_steps"]
    assert all(k <= 0.02 for k in trace[:-1]) and trace[-1] > 0.02
    assert stopped["early_stop"]["kl"] == trace[-1]
    assert trace[0] == pytest.approx(0.0, abs=1e-9)  # unchanged weights: no KL yet


def test_reference_kl_pulls_the_actor_back_to_the_reference(run_after_reward) -> None:
    """With zero advantages only the lambda_ref term acts: its closed form lowers the KL to
    the reference, which mean(log pi - log pi_ref) on samples of pi_old would not."""
    run, cfg = run_after_reward
    cfg = copy.deepcopy(cfg)
    cfg["actor"].update(lr=3e-4, epochs=3, ref_kl=1.0)
    ref, data = _data(run, cfg)
    policy = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameter_groups()["actor"]:
            p.add_(1e-2 * torch.randn(p.shape, generator=gen))
    data = copy.copy(data)
    data.adv = np.zeros_like(data.adv)
    idx = np.arange(len(data))

    def kl_to_ref() -> float:
        with torch.no_grad():
            mu, std = ppo._transition(policy, data, idx, "cpu")
            mu_ref, _ = ppo._transition(ref, data, idx, "cpu")
        return float(sampler.gaussian_kl(mu, mu_ref, std).mean())

    before = kl_to_ref()
    opt = torch.optim.Adam(policy.parameter_groups()["actor"], lr=3e-4)
    cfg["actor"]["logp_old"] = "recompute"  # the perturbed policy is pi_old here
    metrics = ppo.actor_update(policy, ref, data, cfg, opt)
    assert metrics["epochs"][0]["ref_kl"] > 0  # the closed-form term was in the loss
    assert kl_to_ref() < 0.5 * before, (before, kl_to_ref())


def test_logp_check_tolerance_scales_with_the_steps_sensitivity(run_after_reward) -> None:
    """The same |ratio - 1| passes at the most sensitive k* and fails at k* = 1."""
    run, cfg = run_after_reward
    policy, data = _data(run, cfg)
    tol = cfg["actor"]["logp_check_tol"]
    K = data.K
    sens = sampler.logp_sensitivity(K, data.noise_a, data.shift)
    np.testing.assert_allclose(
        ppo.logp_tolerance(data, tol), tol * sens[data.k_star].numpy() / float(sens[1])
    )
    assert {1, K - 1} <= set(data.k_star.tolist())
    late, early = (
        int(np.flatnonzero(data.k_star == K - 1)[0]),
        int(np.flatnonzero(data.k_star == 1)[0]),
    )
    gap = 3 * tol  # inside the late step's tolerance (x sens ratio > 3), outside k* = 1's
    assert float(sens[K - 1] / sens[1]) > 3
    for j, passes in ((late, True), (early, False)):
        off = copy.copy(data)
        off.logp_old = data.logp_old.copy()
        off.logp_old[j] += gap
        if passes:
            ppo.check_logp(policy, off, tol, 8, "cpu")
        else:
            with pytest.raises(ppo.LogProbMismatchError, match="k\\* = 1"):
                ppo.check_logp(policy, off, tol, 8, "cpu")
