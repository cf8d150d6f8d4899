"""PPO clipped loss against a hand computation (both clip branches, both signs of A)."""

from __future__ import annotations

import math

import pytest
import torch

from wamrl.ppo import ppo_loss
from wamrl.sampler import gaussian_kl
from wamrl.training import optimizer_from_tensors, optimizer_to_tensors


def _hand_loss(ratios: list[float], advs: list[float], lo: float, hi: float) -> float:
    terms = []
    for r, a in zip(ratios, advs, strict=True):
        c = min(max(r, 1 - lo), 1 + hi)
        terms.append(min(r * a, c * a))
    return -sum(terms) / len(terms)


RATIOS = [1.5, 0.5, 1.5, 0.5, 1.1, 0.9, 1.25]
ADVS = [1.0, 1.0, -2.0, -2.0, 0.7, -0.3, 1.0]


def _logps(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([-3.0, 1.0, 0.5, -7.0, 2.0, 0.0, -1.0], dtype=torch.float64)
    new = old + torch.log(torch.tensor(ratios, dtype=torch.float64))
    return new, old


def test_ppo_loss_matches_hand_computation_symmetric() -> None:
    new, old = _logps(RATIOS)
    loss, stats = ppo_loss(new, old, torch.tensor(ADVS, dtype=torch.float64), 0.2, 0.2)
    # Branches: r=1.5,A>0 clipped to 1.2; r=0.5,A>0 unclipped 0.5; r=1.5,A<0 unclipped -3;
    # r=0.5,A<0 clipped 0.8*-2; inside range unchanged.
    expected = -(1.2 * 1 + 0.5 * 1 + 1.5 * -2 + 0.8 * -2 + 1.1 * 0.7 + 0.9 * -0.3 + 1.2 * 1) / 7
    assert float(loss) == pytest.approx(expected, rel=1e-9)
    assert float(loss) == pytest.approx(_hand_loss(RATIOS, ADVS, 0.2, 0.2), rel=1e-9)
    assert stats["clip_fraction"] == pytest.approx(5 / 7)  # 1.5, 0.5, 1.5, 0.5, 1.25 outside
    k3 = sum((r - 1) - math.log(r) for r in RATIOS) / 7
    assert stats["approx_kl"] == pytest.approx(k3, rel=1e-9)


def test_ppo_loss_clip_higher_is_asymmetric() -> None:
    new, old = _logps(RATIOS)
    adv = torch.tensor(ADVS, dtype=torch.float64)
    loss_sym, _ = ppo_loss(new, old, adv, 0.2, 0.2)
    loss_hi, stats = ppo_loss(new, old, adv, 0.2, 0.28)
    assert float(loss_hi) == pytest.approx(_hand_loss(RATIOS, ADVS, 0.2, 0.28), rel=1e-9)
    # r = 1.25 with A > 0 is now inside the range: the loss differs by (1.25 - 1.2) / 7.
    assert float(loss_sym) - float(loss_hi) == pytest.approx(
        (1.25 - 1.2 + 1.28 - 1.2) / 7, rel=1e-9
    )
    assert stats["clip_fraction"] == pytest.approx(4 / 7)


def test_ppo_gradient_zero_on_clipped_branch() -> None:
    old = torch.zeros(2, dtype=torch.float64)
    new = torch.log(torch.tensor([1.5, 0.5], dtype=torch.float64)).requires_grad_()
    loss, _ = ppo_loss(new, old, torch.tensor([1.0, -1.0], dtype=torch.float64), 0.2, 0.2)
    loss.backward()
    assert torch.all(new.grad == 0)  # both are clipped: no push beyond the trust region


def test_reference_kl_term_adds_the_closed_form() -> None:
    new, old = _logps(RATIOS)
    adv = torch.tensor(ADVS, dtype=torch.float64)
    kl_ref = torch.tensor([0.1, 0.0, 0.3, 0.2, 0.5, 0.0, 0.4], dtype=torch.float64)
    base, _ = ppo_loss(new, old, adv, 0.2, 0.2)
    with_ref, stats = ppo_loss(new, old, adv, 0.2, 0.2, kl_ref=kl_ref, ref_kl=0.01)
    assert stats["ref_kl"] == pytest.approx(1.5 / 7)
    assert float(with_ref) == pytest.approx(float(base) + 0.01 * 1.5 / 7, rel=1e-9)


def test_gaussian_kl_is_the_kl_of_two_gaussians_with_one_std() -> None:
    from torch.distributions import Normal, kl_divergence

    g = torch.Generator().manual_seed(0)
    mu, mu_ref = torch.randn(3, 32, 7, generator=g), torch.randn(3, 32, 7, generator=g)
    std = torch.tensor([0.2, 0.5, 1.3])[:, None, None].expand(3, 32, 7)
    want = kl_divergence(Normal(mu, std), Normal(mu_ref, std)).flatten(1).sum(1)
    torch.testing.assert_close(gaussian_kl(mu, mu_ref, std), want, rtol=1e-5, atol=1e-6)
    # Its gradient pulls mu toward mu_ref: d KL / d mu = (mu - mu_ref) / std^2.
    mu = mu.requires_grad_()
    gaussian_kl(mu, mu_ref, std).sum().backward()
    torch.testing.assert_close(mu.grad, (mu - mu_ref).detach() / std**2)


def test_optimizer_state_roundtrip() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 2))
    b = torch.nn.Parameter(torch.randn(2))
    opt = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        ((w.sum(0) + b) ** 2).sum().backward()
        opt.step()
    tensors, meta = optimizer_to_tensors(opt, ["w", "b"])
    assert set(tensors) == {f"{n}.{k}" for n in "wb" for k in ("exp_avg", "exp_avg_sq", "step")}
    assert meta["type"] == "Adam"
    w2 = torch.nn.Parameter(w.detach().clone())
    b2 = torch.nn.Parameter(b.detach().clone())
    opt2 = torch.optim.Adam([w2, b2], lr=1e-2)
    assert optimizer_from_tensors(opt2, ["w", "b"], tensors) == 2
    for o, p in ((opt, (w, b)), (opt2, (w2, b2))):
        o.zero_grad()
        ((p[0].sum(0) + p[1]) ** 2).sum().backward()
        o.step()
    torch.testing.assert_close(w2, w)
    torch.testing.assert_close(b2, b)


def test_beta1_zero_steps_along_this_iterations_gradient_alone() -> None:
    """actor.beta1 0: with Adam's state carried over from an earlier iteration, the step is
    -lr g / (sqrt(v_hat) + eps) on this gradient g, whatever the old momentum; at 0.9 the old
    momentum is 90 % of m: the step points mostly where earlier gradients did."""
    from tests.helpers import ONE_LAYER_TINY, make_tiny_policy
    from wamrl.training import trainable_optimizer

    lr, g_old, g_new = 1e-3, 1.0, -0.2

    def step(beta1: float) -> tuple[torch.Tensor, torch.Tensor]:
        policy = make_tiny_policy(config=ONE_LAYER_TINY)
        params, opt = trainable_optimizer(policy, "actor", lr, beta1)
        p = params[0]
        for g in (g_old, g_new):  # an earlier iteration's step, then this one's
            before = p.detach().clone()
            opt.zero_grad()
            p.grad = torch.full_like(p, g)
            opt.step()
        return p.detach() - before, before

    delta, _ = step(0.0)
    v_hat = (0.001 * 0.999 * g_old**2 + 0.001 * g_new**2) / (1 - 0.999**2)
    torch.testing.assert_close(delta, torch.full_like(delta, -lr * g_new / (v_hat**0.5 + 1e-8)))
    delta_momentum, _ = step(0.9)
    m_hat = (0.1 * 0.9 * g_old + 0.1 * g_new) / (1 - 0.9**2)
    assert m_hat > 0 > g_new  # the old gradient wins: the step goes against this one
    torch.testing.assert_close(
        delta_momentum, torch.full_like(delta, -lr * m_hat / (v_hat**0.5 + 1e-8))
    )


def test_ppo_loss_weights_each_sample_of_the_surrogate() -> None:
    new, old = _logps(RATIOS)
    adv = torch.tensor(ADVS, dtype=torch.float64)
    w = torch.tensor([0.5, 2.0, 1.0, 0.25, 3.0, 1.5, 0.1], dtype=torch.float64)
    loss, _ = ppo_loss(new, old, adv, 0.2, 0.2, weight=w)
    terms = [min(r * a, min(max(r, 0.8), 1.2) * a) for r, a in zip(RATIOS, ADVS, strict=True)]
    assert float(loss) == pytest.approx(
        -sum(float(wi) * t for wi, t in zip(w, terms, strict=True)) / 7, rel=1e-9
    )


def test_step_weights_are_the_inverse_sensitivity_scaled_to_mean_one() -> None:
    from wamrl.sampler import step_weights

    K, a, s = 8, 0.5, 5.0
    # by hand: sigma_k = s u / (1 + (s - 1) u), u = 1 - k/K; g = a sqrt(sigma / (1 - sigma));
    # c_k = sqrt(sigma_k - sigma_{k+1}) (1 + a^2/2) / g_k; w_k = (1/c_k) / mean_{1..6}(1/c_j)
    sig = [s * (1 - k / K) / (1 + (s - 1) * (1 - k / K)) for k in range(K + 1)]
    c = [math.sqrt(sig[k] - sig[k + 1]) * (1 + a * a / 2) / (a * math.sqrt(sig[k] / (1 - sig[k])))
         for k in range(1, 7)]  # fmt: skip
    inv = [1 / x for x in c]
    expected = [0.0] + [x / (sum(inv) / 6) for x in inv] + [0.0]
    w = step_weights(K, a, s, high=6)
    assert w.tolist() == pytest.approx(expected, rel=1e-5)
    assert float(w[1:7].mean()) == pytest.approx(1.0, rel=1e-6)
    assert w[1] / w[6] == pytest.approx(c[5] / c[0], rel=1e-5)  # ~11x: the late step's noise
    assert step_weights(K, a, s)[7] > 0  # high defaults to K - 1


def test_a_weighted_update_is_the_update_on_weighted_advantages() -> None:
    """At ratio 1 (the first step) the gradient of -mean(w min(rho A, clip rho A)) is that of
    -mean(rho w A): one SGD step with actor.step_weight equals one without it on advantages
    multiplied by step_weights[k*], and differs from the unweighted step."""
    import copy

    from tests.helpers import ONE_LAYER_TINY, make_tiny_policy
    from tests.test_ddp import _cfg, _data
    from wamrl import ppo
    from wamrl.sampler import step_weights

    data = _data()
    cfg = _cfg(epochs=1, minibatch=len(data), micro_batch=len(data), grad_clip=1e9, ref_kl=0.0)

    def step(d: ppo.ActorData, weight: str) -> list[torch.Tensor]:
        policy = make_tiny_policy(config=ONE_LAYER_TINY)
        params = policy.parameter_groups()["actor"]
        c = copy.deepcopy(cfg)
        c["actor"]["step_weight"] = weight
        ppo.actor_update(policy, None, d, c, torch.optim.SGD(params, lr=1e-3), seed=7)
        return [p.detach().clone() for p in params]

    scaled = copy.copy(data)
    scaled.adv = data.adv * step_weights(data.K, data.noise_a, data.shift).numpy()[data.k_star]
    weighted, by_adv, plain = (
        step(data, "inv_sensitivity"),
        step(scaled, "none"),
        step(data, "none"),
    )
    for a, b in zip(weighted, by_adv, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(weighted, plain, strict=True))


def test_minibatch_null_takes_one_step_per_epoch_on_all_kept_steps() -> None:
    """actor.minibatch null: each optimizer step is the mean over every kept step, computed
    in micro-batches: the same weights as minibatch = len(data), one step per epoch, and
    not those of smaller minibatches."""
    from tests.helpers import ONE_LAYER_TINY, make_tiny_policy
    from tests.test_ddp import _cfg, _data
    from wamrl import ppo

    data = _data()

    def update(minibatch: int | None) -> tuple[list[torch.Tensor], dict]:
        policy = make_tiny_policy(config=ONE_LAYER_TINY)
        params = policy.parameter_groups()["actor"]
        cfg = _cfg(epochs=3, minibatch=minibatch, micro_batch=2, grad_clip=1e9, ref_kl=0.0)
        cfg["actor"]["target_kl"] = None
        m = ppo.actor_update(policy, None, data, cfg, torch.optim.SGD(params, lr=1e-3), seed=7)
        return [p.detach().clone() for p in params], m

    (whole, m_null), (full, _), (halves, m_half) = (
        update(None),
        update(len(data)),
        update(len(data) // 2),
    )
    assert len(data) >= 4
    assert len(m_null["kl_trace"]) == 3 and [e["minibatches"] for e in m_null["epochs"]] == [1] * 3
    assert len(m_half["kl_trace"]) > 3
    for a, b in zip(whole, full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(whole, halves, strict=True))


def test_max_kl_scales_an_overshooting_update_back_along_its_direction() -> None:
    """actor.max_kl: an update whose exact KL from pi_old passes max_kl ends within 0.9-1 x
    max_kl, on the segment from the old weights to the unprojected ones, at the reported
    alpha; an update inside max_kl is left exactly as it was."""
    from tests.helpers import ONE_LAYER_TINY, make_tiny_policy
    from tests.test_ddp import _cfg, _data
    from wamrl import ppo
    from wamrl.master import MasterWeightOptimizer

    data = _data()

    def update(max_kl: float | None) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
        policy = make_tiny_policy(config=ONE_LAYER_TINY)
        params = policy.parameter_groups()["actor"]
        start = [p.detach().clone() for p in params]
        opt = MasterWeightOptimizer(params, lambda ps: torch.optim.Adam(ps, lr=3e-3))
        cfg = _cfg(epochs=2, minibatch=None, micro_batch=4, ref_kl=0.0, max_kl=max_kl)
        m = ppo.actor_update(policy, None, data, cfg, opt, seed=7)
        return start, [p.detach().clone() for p in params], m

    start, free, m_free = update(None)
    assert "kl_projection" not in m_free and m_free["kl"] > 0.02
    _, projected, m = update(0.01)
    assert m["kl_projection"]["kl_before"] == pytest.approx(m_free["kl"], rel=1e-6)
    assert 0.009 <= m["kl"] <= 0.01
    alpha = m["kl_projection"]["alpha"]
    assert 0 < alpha < 1
    for s, f, p in zip(start, free, projected, strict=True):
        torch.testing.assert_close(p, s + alpha * (f - s), rtol=1e-5, atol=1e-7)
    _, inside, m_in = update(1e6)
    assert "kl_projection" not in m_in
    for f, p in zip(free, inside, strict=True):
        torch.testing.assert_close(p, f, rtol=0, atol=0)


def test_trust_region_scale_shrinks_the_update_length_linearly() -> None:
    """actor.anneal linear: (1 - (n - 1) / N)^2 on the KL bounds, held at (1 / N)^2 past N."""
    from wamrl.ppo import trust_region_scale

    assert [trust_region_scale("linear", n, 4) for n in (1, 2, 3, 4, 5, 9)] == [
        1.0, 0.5625, 0.25, 0.0625, 0.0625, 0.0625,
    ]  # fmt: skip
    assert trust_region_scale("linear", 5, 8) == 0.25
    assert trust_region_scale("none", 7, 8) == 1.0
    with pytest.raises(ValueError, match="unknown schedule 'cosine'"):
        trust_region_scale("cosine", 1, 8)
    with pytest.raises(ValueError, match="iteration 0 of 8"):
        trust_region_scale("linear", 0, 8)


def test_kl_scale_shrinks_both_bounds_of_the_update() -> None:
    """kl_scale 0.25 on max_kl 0.04 ends the update at KL 0.009-0.01, as max_kl 0.01 does,
    and metrics.json trust_region records the bounds used."""
    from tests.helpers import ONE_LAYER_TINY, make_tiny_policy
    from tests.test_ddp import _cfg, _data
    from wamrl import ppo
    from wamrl.master import MasterWeightOptimizer

    policy = make_tiny_policy(config=ONE_LAYER_TINY)
    opt = MasterWeightOptimizer(
        policy.parameter_groups()["actor"], lambda ps: torch.optim.Adam(ps, lr=3e-3)
    )
    cfg = _cfg(epochs=2, minibatch=None, micro_batch=4, ref_kl=0.0, max_kl=0.04, target_kl=0.2)
    m = ppo.actor_update(policy, None, _data(), cfg, opt, seed=7, kl_scale=0.25)
    assert m["trust_region"] == {"scale": 0.25, "target_kl": 0.05, "max_kl": 0.01}
    assert m["kl_projection"]["kl_before"] > 0.01
    assert 0.009 <= m["kl"] <= 0.01


def test_actor_stage_anneals_the_trust_region_over_the_runs_iterations(
    tmp_path, monkeypatch
) -> None:
    """The actor stage scales the bounds by trust_region_scale(anneal, n, pipeline.iterations)."""
    from tests.test_master import _cfg, _policy, _run_actor_stage

    cfg = _cfg(1, 4)
    cfg["actor"].update(anneal="linear", target_kl=0.04, max_kl=0.02, amp=None)
    cfg["pipeline"]["iterations"] = 4
    m = _run_actor_stage(monkeypatch, tmp_path, 3, _policy(torch.float32), cfg)
    assert m["trust_region"] == {"scale": 0.25, "target_kl": 0.01, "max_kl": 0.005}


@pytest.mark.parametrize("power", [1.0, 1.3, 2.0, 3.0])
@pytest.mark.parametrize("kl", [0.0108, 0.0206, 0.2])
def test_search_alpha_lands_in_the_window_for_any_power_law(power: float, kl: float) -> None:
    """KL(alpha) = kl * alpha^power: the search ends within 0.9-1 x max_kl in a few tries,
    where the square law alone aimed at max_kl lands just over it every time for power < 2
    (iteration 1 of the H100 run of 2026-12-07 kept alpha 0 after 7 passes)."""
    from wamrl.ppo import search_alpha

    tried: list[float] = []

    def kl_at(alpha: float) -> float:
        tried.append(alpha)
        return kl * alpha**power

    alpha, passes = search_alpha(kl_at, kl, 0.01)
    assert 0.009 <= kl * alpha**power <= 0.01
    assert passes == len(tried) <= 4 and alpha == tried[-1]
    # the old rule: alpha *= sqrt(max_kl / KL(alpha)), from alpha 1, KL(1.3 power) stays over
    a = 1.0
    for _ in range(6):
        a *= math.sqrt(0.01 / (kl * a**1.3))
        assert kl * a**1.3 > 0.01


def test_search_alpha_keeps_the_highest_alpha_under_max_kl_when_the_window_is_missed() -> None:
    """A KL that jumps over the window (a step function): no try lands in 0.9-1 x max_kl, so
    the search returns the highest alpha it found under max_kl, after all its tries."""
    from wamrl.ppo import search_alpha

    def kl_at(alpha: float) -> float:
        return 0.002 if alpha < 0.4 else 0.03

    alpha, passes = search_alpha(kl_at, 0.03, 0.01, tries=8)
    assert passes == 8 and 0.35 < alpha < 0.4


def test_kl_by_task_is_each_tasks_mean_of_the_exact_step_kl() -> None:
    """Two tasks, std 0.5: a step whose mean moves by d in one of its 224 entries has KL
    d^2 / (2 * 0.25); task 3's steps moved 0.1 and 0.3, task 7's did not move."""
    import numpy as np

    from wamrl.ppo import LearnerPass, kl_by_k_star

    mu = np.zeros((3, 32, 7), np.float32)
    before = LearnerPass(np.zeros(3), mu, np.full(3, 0.5, np.float32))
    moved = mu.copy()
    moved[0, 0, 0], moved[1, 5, 2] = 0.1, 0.3
    after = LearnerPass(np.zeros(3), moved, before.std)
    out = kl_by_k_star(before, after, np.array([1, 7, 7]), 8, np.array([3, 3, 7]))
    kl = [0.01 / 0.5, 0.09 / 0.5, 0.0]
    assert out["kl"] == pytest.approx(sum(kl) / 3)
    assert out["kl_by_k_star"] == {"1": pytest.approx(kl[0]), "7": pytest.approx(kl[1] / 2)}
    assert out["kl_by_task"] == {"3": pytest.approx((kl[0] + kl[1]) / 2), "7": 0.0}
