"""The mixed ODE/SDE sampler against its formulas (docs/design.md "The sampler").

References are computed independently in float64 numpy from the written formulas:
    sigma_k = phi(1 - k/K), phi(u) = s u / (1 + (s - 1) u)
    ODE  x' = x + (sigma' - sigma) v
    SDE  Delta = sigma - sigma', g = a sqrt(sigma / (1 - sigma)),
         mu = x - Delta [v + g^2 / (2 sigma) (x + (1 - sigma) v)], std = g sqrt(Delta)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from tests.helpers import make_obs, make_tiny_policy
from wamrl.contract import ACTION_DIM, CHUNK_LEN
from wamrl.sampler import (
    gaussian_log_prob,
    ode_step,
    recompute_log_prob,
    sample_chunk,
    sde_mean_std,
    sigma_schedule,
)

SHIFT = 5.0


# ----------------------------------------------------------------------------- references


def phi_ref(u: np.ndarray, s: float) -> np.ndarray:
    return s * u / (1.0 + (s - 1.0) * u)


def sde_ref(
    x: np.ndarray, v: np.ndarray, sigma: float, sigma_next: float, a: float
) -> tuple[np.ndarray, float]:
    delta = sigma - sigma_next
    g = a * math.sqrt(sigma / (1.0 - sigma))
    mu = x - delta * (v + g**2 / (2.0 * sigma) * (x + (1.0 - sigma) * v))
    return mu, g * math.sqrt(delta)


# A fixed velocity field, written twice: torch (for the sampler) and numpy float64 (reference).
_RNG = np.random.default_rng(1234)
VB = _RNG.standard_normal((CHUNK_LEN, ACTION_DIM))
VC = _RNG.standard_normal((CHUNK_LEN, ACTION_DIM))


def fake_velocity_ref(x: np.ndarray, sigma: float) -> np.ndarray:
    return 0.3 * x + sigma * VB + 0.5 * VC


class FakePolicy(nn.Module):
    """Deterministic velocity v(x, sigma) = 0.3 x + sigma B + 0.5 C; no parameters (CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.tensor(VB, dtype=torch.float32))
        self.register_buffer("c", torch.tensor(VC, dtype=torch.float32))

    def velocity(self, cache, x: Tensor, sigma: Tensor) -> Tensor:
        return 0.3 * x + sigma[:, None, None] * self.b + 0.5 * self.c


# ----------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("K", [1, 2, 8, 20])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_sigma_schedule_formula(K: int, shift: float) -> None:
    s = sigma_schedule(K, shift)
    assert s.shape == (K + 1,) and s.dtype == torch.float32
    assert float(s[0]) == 1.0 and float(s[-1]) == 0.0
    assert bool((s[1:] < s[:-1]).all()), "strictly decreasing from noise to data"
    ref = phi_ref(1.0 - np.arange(K + 1) / K, shift)
    np.testing.assert_allclose(s.numpy(), ref, rtol=1e-6, atol=1e-7)


def test_sigma_schedule_hand_values() -> None:
    # K = 4, s = 5: u = 1, .75, .5, .25, 0 -> 1, 3.75/4, 2.5/3, 1.25/2, 0
    s = sigma_schedule(4, 5.0).numpy()
    np.testing.assert_allclose(s, [1.0, 0.9375, 2.5 / 3.0, 0.625, 0.0], rtol=1e-6)


# ----------------------------------------------------------------------------- step math


@pytest.mark.parametrize("a", [0.2, 0.5, 1.0])
@pytest.mark.parametrize(("K", "k"), [(8, 1), (8, 4), (8, 7), (20, 10)])
def test_sde_mean_std_match_hand_formula(a: float, K: int, k: int) -> None:
    rng = np.random.default_rng(k * 100 + K)
    x = rng.standard_normal((3, CHUNK_LEN, ACTION_DIM))
    v = rng.standard_normal((3, CHUNK_LEN, ACTION_DIM))
    sig = phi_ref(1.0 - np.arange(K + 1) / K, SHIFT)
    mu_ref, std_ref = sde_ref(x, v, sig[k], sig[k + 1], a)
    sigmas = sigma_schedule(K, SHIFT)
    # scalar sigma and per-row [B] sigma must agree
    for s, s_next in [
        (sigmas[k], sigmas[k + 1]),
        (sigmas[k].expand(3), sigmas[k + 1].expand(3)),
    ]:
        mu, std = sde_mean_std(torch.tensor(x), torch.tensor(v), s, s_next, a)
        assert mu.dtype == torch.float32 and std.shape == mu.shape
        np.testing.assert_allclose(mu.numpy(), mu_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(std.numpy(), std_ref, rtol=1e-5)


def test_sde_mean_std_per_row_sigma() -> None:
    """Each row uses its own sigma (the learner recomputes at a different k* per row)."""
    K = 8
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, CHUNK_LEN, ACTION_DIM))
    v = rng.standard_normal((3, CHUNK_LEN, ACTION_DIM))
    ks = [1, 3, 6]
    sig = phi_ref(1.0 - np.arange(K + 1) / K, SHIFT)
    sigmas = sigma_schedule(K, SHIFT)
    kt = torch.tensor(ks)
    mu, std = sde_mean_std(torch.tensor(x), torch.tensor(v), sigmas[kt], sigmas[kt + 1], 0.5)
    for i, k in enumerate(ks):
        mu_ref, std_ref = sde_ref(x[i], v[i], sig[k], sig[k + 1], 0.5)
        np.testing.assert_allclose(mu[i].numpy(), mu_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(std[i].numpy(), std_ref, rtol=1e-5)


def test_ode_step_formula() -> None:
    x, v = torch.randn(2, CHUNK_LEN, ACTION_DIM), torch.randn(2, CHUNK_LEN, ACTION_DIM)
    out = ode_step(x, v, torch.tensor(0.8), torch.tensor(0.5))
    torch.testing.assert_close(out, x - 0.3 * v)
    per_row = ode_step(x, v, torch.tensor([0.8, 0.6]), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(per_row[1], x[1] - 0.1 * v[1])


def test_gaussian_log_prob_matches_torch_normal() -> None:
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(4, CHUNK_LEN, ACTION_DIM, generator=g, dtype=torch.float64)
    std = 0.05 + torch.rand(4, CHUNK_LEN, ACTION_DIM, generator=g, dtype=torch.float64)
    x = mu + std * torch.randn(4, CHUNK_LEN, ACTION_DIM, generator=g, dtype=torch.float64)
    ref = torch.distributions.Normal(mu, std).log_prob(x).sum((1, 2))
    out = gaussian_log_prob(x, mu, std)
    assert out.shape == (4,) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-3)


# ----------------------------------------------------------------------------- the sampler


def test_sde_step_samples_have_the_stated_mean_and_std() -> None:
    """20000 chains from one x_0 with k* fixed: x_{k*} is deterministic, x_{k*+1} ~ N(mu, std^2)
    with mu, std from the float64 hand formula (each entry within ~4.5 standard errors)."""
    n, K, a, ks = 20000, 8, 0.5, 3
    x0 = torch.tensor(np.random.default_rng(3).standard_normal((CHUNK_LEN, ACTION_DIM)))
    res = sample_chunk(
        FakePolicy(),
        None,
        n,
        K,
        a,
        SHIFT,
        torch.Generator().manual_seed(11),
        x0=x0.float().expand(n, -1, -1),
        k_star=torch.full((n,), ks),
    )
    # hand-rolled float64 reference up to step k* (pure ODE)
    sig = phi_ref(1.0 - np.arange(K + 1) / K, SHIFT)
    x = x0.float().double().numpy()
    for k in range(ks):
        x = x + (sig[k + 1] - sig[k]) * fake_velocity_ref(x, sig[k])
    np.testing.assert_allclose(res.chain[0, ks].numpy(), x, rtol=1e-4, atol=1e-4)
    assert bool((res.chain[:, ks] == res.chain[0, ks]).all())
    mu_ref, std_ref = sde_ref(x, fake_velocity_ref(x, sig[ks]), sig[ks], sig[ks + 1], a)
    # the SDE mean is far from the ODE step (so a wrong drift cannot hide in the noise)
    ode_next = x + (sig[ks + 1] - sig[ks]) * fake_velocity_ref(x, sig[ks])
    se = std_ref / math.sqrt(n)
    assert np.abs(ode_next - mu_ref).max() > 10 * se

    samples = res.chain[:, ks + 1].double().numpy()
    mean, sd = samples.mean(0), samples.std(0, ddof=1)
    assert np.abs(mean - mu_ref).max() < 4.5 * se
    assert np.abs(sd - std_ref).max() < 4.5 * std_ref / math.sqrt(2 * n)
    z = (samples - mu_ref) / std_ref  # pooled: standard normal
    assert abs(z.mean()) < 4 / math.sqrt(z.size)
    assert abs(z.var() - 1.0) < 4 * math.sqrt(2 / z.size)
    # logp is that Gaussian's density of the drawn sample, summed over 32 x 7
    lp_ref = (-0.5 * z**2 - math.log(std_ref) - 0.5 * math.log(2 * math.pi)).sum((1, 2))
    np.testing.assert_allclose(res.logp[:50].numpy(), lp_ref[:50], rtol=1e-4, atol=2e-3)
    # every other step is a plain ODE step (also after k*)
    for k in range(ks + 1, K):
        xk = res.chain[:64, k].double().numpy()
        ref = xk + (sig[k + 1] - sig[k]) * fake_velocity_ref(xk, sig[k])
        np.testing.assert_allclose(res.chain[:64, k + 1].numpy(), ref, rtol=1e-4, atol=1e-4)


def test_k_star_is_uniform_on_1_to_K_minus_1_and_x0_fresh() -> None:
    n, K = 3500, 8
    gen = torch.Generator().manual_seed(5)
    res = sample_chunk(FakePolicy(), None, n, K, 0.5, SHIFT, gen)
    counts = torch.bincount(res.k_star, minlength=K).numpy()
    assert counts[0] == 0 and counts.sum() == n
    p = 1.0 / (K - 1)
    se = math.sqrt(n * p * (1 - p))
    assert np.abs(counts[1:] - n * p).max() < 4.5 * se
    x0 = res.chain[:, 0].double().numpy()  # x_0 ~ N(0, I), fresh per env
    assert abs(x0.mean()) < 4 / math.sqrt(x0.size)
    assert abs(x0.var() - 1.0) < 4 * math.sqrt(2 / x0.size)
    again = sample_chunk(FakePolicy(), None, n, K, 0.5, SHIFT, gen)  # the next query
    assert not torch.equal(again.chain[:, 0], res.chain[:, 0])


def test_sde_needs_a_valid_k_star() -> None:
    """K = 1 has no SDE step with sigma < 1 (it used to give NaN chains); k* = 0 neither."""
    pol = FakePolicy()
    with pytest.raises(ValueError, match="K >= 2"):
        sample_chunk(pol, None, 2, 1, 0.5, SHIFT, None)
    with pytest.raises(ValueError, match="k\\*"):
        sample_chunk(pol, None, 2, 8, 0.5, SHIFT, None, k_star=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="k\\*"):
        sample_chunk(pol, None, 2, 8, 0.5, SHIFT, None, k_star=torch.tensor([8, 3]))
    res = sample_chunk(pol, None, 2, 1, 0.0, SHIFT, None)  # a = 0, K = 1 is a plain ODE step
    assert bool(torch.isfinite(res.chain).all())


# ----------------------------------------------------------------------------- the real tiny model
# make_tiny_policy(perturb="signal"): LoRA B and action positions drawn, the attention left as
# initialised (conftest's tiny_policy also sharpens it).


def test_a_zero_is_the_pure_ode_sampler() -> None:
    model, K = make_tiny_policy(perturb="signal").eval(), 6
    obs = make_obs(b=3, ctx_len=6, row0_len=4)
    x0 = torch.randn(3, CHUNK_LEN, ACTION_DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.prefill(obs)
        res = sample_chunk(model, cache, 3, K, 0.0, SHIFT, torch.Generator().manual_seed(2), x0=x0)
        sig = sigma_schedule(K, SHIFT)
        x, ref = x0, [x0]
        for k in range(K):
            x = ode_step(x, model.velocity(cache, x, sig[k].expand(3)), sig[k], sig[k + 1])
            ref.append(x)
    assert res.chain.shape == (3, K + 1, CHUNK_LEN, ACTION_DIM)
    torch.testing.assert_close(res.chain, torch.stack(ref, 1), rtol=0, atol=1e-6)
    assert not torch.allclose(res.chain[:, -1], x0, atol=1e-2)
    assert torch.equal(res.k_star, torch.zeros(3, dtype=torch.long))
    assert torch.equal(res.logp, torch.zeros(3))
    # no randomness beyond x_0: another generator gives the same chain
    with torch.no_grad():
        res2 = sample_chunk(model, cache, 3, K, 0.0, SHIFT, torch.Generator().manual_seed(9), x0=x0)
    assert torch.equal(res.chain, res2.chain)


def test_mixed_sampler_chain_and_logp_with_the_tiny_model() -> None:
    model, K, a, b = make_tiny_policy(perturb="signal").eval(), 8, 0.5, 4
    obs = make_obs(b=b, ctx_len=6, row0_len=4)
    with torch.no_grad():
        cache = model.prefill(obs)
        x0 = torch.randn(b, CHUNK_LEN, ACTION_DIM, generator=torch.Generator().manual_seed(1))
        res = sample_chunk(
            model, cache, b, K, a, SHIFT, torch.Generator().manual_seed(2), x0=x0.clone()
        )
        ks = res.k_star
        assert ks.dtype == torch.long and bool(((ks >= 1) & (ks <= K - 1)).all())
        assert res.chain.shape == (b, K + 1, CHUNK_LEN, ACTION_DIM)
        assert torch.equal(res.chain[:, 0], x0)
        sig = sigma_schedule(K, SHIFT)
        rows = torch.arange(b)
        for k in range(K):
            xk = res.chain[:, k]
            v = model.velocity(cache, xk, sig[k].expand(b))
            ode = ode_step(xk, v, sig[k], sig[k + 1])
            for i in range(b):
                if k == int(ks[i]):  # the SDE step is not the ODE step
                    assert (res.chain[i, k + 1] - ode[i]).abs().max() > 1e-2
                else:
                    assert torch.equal(res.chain[i, k + 1], ode[i]), (i, k)
        x_k, x_next = res.chain[rows, ks], res.chain[rows, ks + 1]
        lp = recompute_log_prob(model, obs, x_k, x_next, ks, K, a, SHIFT)
        assert lp.shape == (b,) and bool(torch.isfinite(res.logp).all())
        assert (lp - res.logp).abs().max() <= 1e-4
        # with a precomputed cache as well
        lp_c = recompute_log_prob(model, None, x_k, x_next, ks, K, a, SHIFT, cache=cache)
        assert (lp_c - res.logp).abs().max() <= 1e-4
        # other weights in the action expert: a different log-probability
        model.action_blocks[0].ffn[0].weight.add_(
            0.2 * torch.randn_like(model.action_blocks[0].ffn[0].weight)
        )
        lp2 = recompute_log_prob(model, obs, x_k, x_next, ks, K, a, SHIFT)
        assert (lp2 - res.logp).abs().min() > 1e-2
    # the learner's path carries gradients to the action expert
    lp3 = recompute_log_prob(model, None, x_k, x_next, ks, K, a, SHIFT, cache=cache)
    lp3.sum().backward()
    assert model.action_outp.weight.grad is not None
    assert float(model.action_outp.weight.grad.abs().sum()) > 0


def test_logp_sensitivity_is_the_gradient_of_log_pi_in_the_velocity() -> None:
    """|d log pi / d v| = |xi| sqrt(Delta) (1 + a^2/2) / g_k at every SDE step (autograd)."""
    from wamrl.sampler import logp_sensitivity

    K, a = 8, 0.5
    sens = logp_sensitivity(K, a, SHIFT)
    sig = sigma_schedule(K, SHIFT).double()
    g = torch.Generator().manual_seed(0)
    for k in range(1, K):
        x, xi = torch.randn(2, 1, 32, 7, generator=g)
        v = torch.randn(1, 32, 7, generator=g).requires_grad_()
        mu, std = sde_mean_std(x, v, sig[k], sig[k + 1], a)
        x_next = (mu + std * xi).detach()  # a sample of this step: x_{k+1} - mu = std xi
        gaussian_log_prob(x_next, mu, std).sum().backward()
        ratio = (v.grad.abs() / xi.abs()).flatten()
        torch.testing.assert_close(ratio, torch.full_like(ratio, float(sens[k])), rtol=1e-3, atol=0)
    assert float(sens[K - 1] / sens[1]) == pytest.approx(24.25, abs=0.01)


# ----------------------------------------------------------------------------- k*


def test_draw_kstar_is_the_one_k_star_draw_and_takes_a_range() -> None:
    """Default 1..K-1: the numbers torch.randint(1, K) gives for the same generator state (so
    stores drawn before stay valid); a narrower range draws only inside it; check_kstar
    accepts exactly the range; an empty range or one touching step 0 or K is refused."""
    from wamrl.sampler import check_kstar, draw_kstar, kstar_bounds

    K = 8
    got = draw_kstar(500, K, torch.Generator().manual_seed(4))
    assert torch.equal(got, torch.randint(1, K, (500,), generator=torch.Generator().manual_seed(4)))
    assert got.dtype == torch.long and set(got.tolist()) == set(range(1, K))
    narrow = draw_kstar(500, K, torch.Generator().manual_seed(4), low=3, high=5)
    assert set(narrow.tolist()) == {3, 4, 5}
    check_kstar(torch.tensor([1, 7]), K)
    check_kstar(torch.tensor([3, 5]), K, low=3, high=5)
    for bad, rng in ((0, {}), (8, {}), (2, {"low": 3, "high": 5}), (6, {"low": 3, "high": 5})):
        with pytest.raises(ValueError, match="k\\*"):
            check_kstar(torch.tensor([bad]), K, **rng)
    assert kstar_bounds(K) == (1, K - 1)
    with pytest.raises(ValueError, match="K >= 2"):
        draw_kstar(1, 1, None)
    for low, high in ((0, 3), (2, 8), (5, 4)):
        with pytest.raises(ValueError, match="k\\* range"):
            kstar_bounds(K, low, high)


def test_kstar_max_bounds_every_sampler_path() -> None:
    """sampler.kstar_max reaches draw_noise on each path: the eager sampler and the graphed
    one (eager on a CPU) draw k* only in 1..kstar_max, from the same generator numbers as
    draw_kstar; a given per-row k* above it is refused."""
    from wamrl.graphed import GraphedSampler
    from wamrl.sampler import draw_kstar, draw_noise

    K, high, B = 8, 3, 64
    _, k_star, _ = draw_noise(B, K, 0.5, torch.Generator().manual_seed(1), kstar_max=high)
    gen = torch.Generator().manual_seed(1)
    torch.randn(B, CHUNK_LEN, ACTION_DIM, generator=gen)  # x_0 comes first
    assert torch.equal(k_star, draw_kstar(B, K, gen, high=high))
    assert set(k_star.tolist()) == {1, 2, 3}
    with pytest.raises(ValueError, match="k\\* must lie in 1..3"):
        draw_noise(1, K, 0.5, None, torch.zeros(1, CHUNK_LEN, ACTION_DIM), torch.tensor([5]),
                   torch.zeros(1, CHUNK_LEN, ACTION_DIM), kstar_max=high)  # fmt: skip

    model = make_tiny_policy(perturb="signal").eval()
    obs = make_obs(b=B, ctx_len=6, row0_len=4)
    eager = sample_chunk(model, model.prefill(obs), B, K, 0.5, 5.0,
                         torch.Generator().manual_seed(2), kstar_max=high)  # fmt: skip
    graphed = GraphedSampler(model, K, 0.5, 5.0, B, kstar_max=high)
    out = graphed.query(obs, torch.Generator().manual_seed(2))
    assert int(eager.k_star.max()) == high and torch.equal(out.k_star.cpu(), eager.k_star.cpu())
    torch.testing.assert_close(out.chain, eager.chain)
