"""The mixed ODE/SDE flow sampler (piRL Flow-SDE) and its log-probabilities.

Convention: x_sigma = (1 - sigma) a + sigma eps, v = eps - a; sigma = 1 noise, 0 data.
Schedule (shift s): sigma_k = phi(1 - k/K), phi(u) = s u / (1 + (s - 1) u), k = 0..K.

    ODE step  x_{k+1} = x_k + (sigma_{k+1} - sigma_k) v
    SDE step  Delta = sigma_k - sigma_{k+1},  g = a sqrt(sigma_k / (1 - sigma_k))
              mu = x_k - Delta [v + g^2 / (2 sigma_k) (x_k + (1 - sigma_k) v)]
              std = g sqrt(Delta),  x_{k+1} = mu + std xi

Per query and env: x_0 ~ N(0, I) fresh, k* ~ U{1..K-1} (k* >= 1 avoids sigma = 1 where g
is infinite); step k* is the SDE step, every other step is ODE. log pi_old is the Gaussian
log-density of x_{k*+1} given x_{k*}, summed over the 32 x 7 entries, always in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from wamrl.contract import ACTION_DIM, CHUNK_LEN
from wamrl.policy.base import Obs, Policy


def sigma_schedule(K: int, shift: float = 5.0) -> Tensor:
    """[K + 1] sigmas from 1 to 0 (computed in float64, returned float32)."""
    u = 1.0 - torch.arange(K + 1, dtype=torch.float64) / K
    return (shift * u / (1.0 + (shift - 1.0) * u)).float()


def official_sigmas(K: int, shift: float = 5.0) -> Tensor:
    """[K + 1] sigmas as Fast-WAM's `build_inference_schedule` makes them: phi of a float32
    linspace, in float32 (sigma_schedule's float64 values can differ from these by an ulp)."""
    u = torch.linspace(1.0, 0.0, K + 1, dtype=torch.float32)
    return shift * u / (1.0 + (shift - 1.0) * u)


def ode_step(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    return x + _bcast(sigma_next - sigma, x) * v


def sde_mean_std(
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, a: float
) -> tuple[Tensor, Tensor]:
    """Mean and std of the Flow-SDE transition x_k -> x_{k+1}, float32. sigma: [B] or scalar."""
    x, v = x.float(), v.float()
    s = _bcast(torch.as_tensor(sigma, dtype=torch.float32, device=x.device), x)
    s_next = _bcast(torch.as_tensor(sigma_next, dtype=torch.float32, device=x.device), x)
    delta = s - s_next
    g = a * torch.sqrt(s / (1.0 - s))
    mu = x - delta * (v + (g**2 / (2.0 * s)) * (x + (1.0 - s) * v))
    std = g * torch.sqrt(delta)
    return mu, std.expand_as(mu)


def gaussian_log_prob(x_next: Tensor, mu: Tensor, std: Tensor) -> Tensor:
    """log N(x_next; mu, std^2) summed over every dim but the first, in float32: [B]."""
    x_next, mu, std = x_next.float(), mu.float(), std.float()
    z = (x_next - mu) / std
    logp = -0.5 * z**2 - torch.log(std) - 0.5 * math.log(2.0 * math.pi)
    return logp.flatten(1).sum(1)


@dataclass
class SampleResult:
    chain: Tensor  # [B, K + 1, 32, 7]: x_0 (noise) ... x_K (the action chunk)
    k_star: Tensor  # [B] int64, the SDE step (0 when a = 0: no stochastic step)
    logp: Tensor  # [B] float32 log pi_old of x_{k*+1} given x_{k*} (0 when a = 0)


def kstar_bounds(K: int, low: int = 1, high: int | None = None) -> tuple[int, int]:
    """The SDE steps k* may take, low..high inclusive (default 1..K-1). Step 0 is never one:
    sigma_0 = 1, where g is infinite; step K does not exist."""
    if K < 2:
        raise ValueError(f"a > 0 needs K >= 2 (k* lies in 1..K-1, sigma_0 = 1), got K = {K}")
    high = K - 1 if high is None else high
    if not 1 <= low <= high <= K - 1:
        raise ValueError(f"the k* range {low}..{high} must be non-empty and lie in 1..{K - 1}")
    return low, high


def draw_kstar(
    n: int, K: int, generator: torch.Generator | None, low: int = 1, high: int | None = None
) -> Tensor:
    """[n] int64 SDE steps, uniform on low..high (default 1..K-1): the one place k* is drawn,
    so the batched sampler, the CUDA graph path and per-episode noise draw the same numbers."""
    low, high = kstar_bounds(K, low, high)
    return torch.randint(low, high + 1, (n,), generator=generator)


def check_kstar(k_star: Tensor, K: int, low: int = 1, high: int | None = None) -> None:
    """ValueError unless every k* lies in low..high (default 1..K-1)."""
    low, high = kstar_bounds(K, low, high)
    if bool(((k_star < low) | (k_star > high)).any()):
        raise ValueError(f"k* must lie in {low}..{high}, got {k_star.tolist()}")


def draw_noise(
    batch: int,
    K: int,
    a: float,
    generator: torch.Generator | None,
    x0: Tensor | None = None,
    k_star: Tensor | None = None,
    xi: Tensor | None = None,
    kstar_max: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(x_0 [B, 32, 7], k* [B], xi [B, 32, 7]) on the CPU; xi[b] is row b's SDE noise.
    k* lies in 1..kstar_max (default K - 1: sampler.kstar_max), drawn or checked.

    What is given (per-episode noise, wamrl.rollout) is used as it is; the rest is drawn from
    `generator` in a fixed order: x_0, k*, then one full-batch randn for each step that is
    some row's SDE step, in step order. Every sampler path draws through here, so one
    generator state gives one set of numbers whichever path (eager or graphed) runs."""
    if x0 is None:
        if k_star is not None and xi is not None:
            raise ValueError("per-row k_star and xi need a per-row x0 too")
        x0 = torch.randn(batch, CHUNK_LEN, ACTION_DIM, generator=generator)
    if k_star is None:
        no_sde = torch.zeros(batch, dtype=torch.long)
        k_star = draw_kstar(batch, K, generator, high=kstar_max) if a > 0 else no_sde
    elif a > 0:
        check_kstar(k_star, K, high=kstar_max)
    k_star = k_star.long().cpu()
    if xi is None:
        xi = torch.zeros(batch, CHUNK_LEN, ACTION_DIM)
        for k in range(K if a > 0 else 0):
            rows = k_star == k
            if bool(rows.any()):
                xi[rows] = torch.randn(batch, CHUNK_LEN, ACTION_DIM, generator=generator)[rows]
    return x0.float().cpu(), k_star, xi.float().cpu()


def denoise(
    policy: Policy, cache: Any, x0: Tensor, k_star: Tensor, xi: Tensor, sigmas: Tensor, a: float
) -> tuple[Tensor, Tensor]:
    """K steps over a prefilled cache, every input on the model's device: (chain [B, K+1, 32,
    7], logp [B]). No host synchronisation (a CUDA graph can record it): the SDE step is
    computed for every row at every k >= 1 and kept by torch.where where k = k*."""
    K = sigmas.shape[0] - 1
    x = x0
    chain = [x]
    logp = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    for k in range(K):
        s, s_next = sigmas[k], sigmas[k + 1]
        v = policy.velocity(cache, x, s.expand(x.shape[0])).float()
        x_next = ode_step(x, v, s, s_next)
        if a > 0 and k >= 1:  # k* >= 1, so step 0 is always ODE
            mu, std = sde_mean_std(x, v, s, s_next, a)
            x_sde = mu + std * xi
            sde = k_star == k
            x_next = torch.where(sde[:, None, None], x_sde, x_next)
            logp = torch.where(sde, gaussian_log_prob(x_sde, mu, std), logp)
        x = x_next
        chain.append(x)
    return torch.stack(chain, 1), logp


def sample_chunk(
    policy: Policy,
    cache: Any,
    batch: int,
    K: int,
    a: float,
    shift: float,
    generator: torch.Generator | None,
    x0: Tensor | None = None,
    k_star: Tensor | None = None,
    scheduler_dtype: torch.dtype = torch.float32,
    xi: Tensor | None = None,
    kstar_max: int | None = None,
) -> SampleResult:
    """Denoise a batch of chunks over a prefilled cache with the mixed sampler.

    a = 0 is the pure ODE sampler (evaluation): no step is stochastic, k* and logp are 0.
    scheduler_dtype bf16 (a = 0 only; eval.protocol official on a bf16 model) holds x_k and
    the step sizes in bf16, as Fast-WAM's `infer_action` does: x_{k+1} = x_k + v * delta in
    bf16, sigmas from `official_sigmas`. The chain is returned in float32.
    x0 [B, 32, 7], k_star [B], xi [B, 32, 7] (row b's SDE noise): given, they replace the
    draws from `generator` (per-episode noise: a row's numbers do not depend on its batch).
    kstar_max: the highest SDE step (draw_noise).
    """
    device = _device_of(policy)
    if scheduler_dtype != torch.float32:
        if x0 is None:
            x0 = torch.randn(batch, CHUNK_LEN, ACTION_DIM, generator=generator)
        if a > 0:  # log pi needs float32 SDE arithmetic (the bf16 ratio pitfall)
            raise ValueError(f"scheduler_dtype {scheduler_dtype} needs a = 0, got a = {a}")
        return _sample_ode_low_precision(policy, cache, batch, K, shift, x0, scheduler_dtype)
    x0, k_star, xi = draw_noise(batch, K, a, generator, x0, k_star, xi, kstar_max)
    k_star = k_star.to(device)
    sigmas = sigma_schedule(K, shift).to(device)
    chain, logp = denoise(policy, cache, x0.to(device), k_star, xi.to(device), sigmas, a)
    return SampleResult(chain, k_star, logp)


def _sample_ode_low_precision(
    policy: Policy, cache: Any, batch: int, K: int, shift: float, x0: Tensor, dtype: torch.dtype
) -> SampleResult:
    """The pure ODE chain of Fast-WAM's `infer_action` loop (sample_chunk's scheduler_dtype):
    x_k, and the step sizes sigma_{k+1} - sigma_k computed in float32, held in `dtype`."""
    device = _device_of(policy)
    sigmas = official_sigmas(K, shift).to(device)
    deltas = (sigmas[1:] - sigmas[:-1]).to(dtype)
    x = x0.to(device=device, dtype=dtype)
    chain = [x.float()]
    for k in range(K):
        v = policy.velocity(cache, x, sigmas[k].expand(batch))
        x = x + v.to(dtype) * deltas[k]  # Fast-WAM's scheduler.step: sample + output * delta
        chain.append(x.float())
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    return SampleResult(torch.stack(chain, 1), zeros, torch.zeros(batch, device=device))


def recompute_mean_std(
    policy: Policy,
    obs: Obs | None,
    x_k: Tensor,
    k_star: Tensor,
    K: int,
    a: float,
    shift: float,
    cache: Any = None,
) -> tuple[Tensor, Tensor]:
    """The learner's grad-capable path: mean and std of the SDE step x_{k*} -> x_{k*+1}.

    Uncompiled and eager. Pass `cache` computed under no_grad (the actor's gradient then stops
    at the first-frame cache, seed 002 section 8.3); otherwise it is built from `obs` here.
    """
    if cache is None:
        if obs is None:
            raise ValueError("recompute needs obs or a cache")
        cache = policy.prefill(obs)
    sigmas = sigma_schedule(K, shift).to(x_k.device)
    k_star = k_star.to(device=x_k.device, dtype=torch.long)
    check_kstar(k_star, K)
    s, s_next = sigmas[k_star], sigmas[k_star + 1]
    v = policy.velocity(cache, x_k, s)
    return sde_mean_std(x_k, v, s, s_next, a)


def recompute_log_prob(
    policy: Policy,
    obs: Obs | None,
    x_k: Tensor,
    x_next: Tensor,
    k_star: Tensor,
    K: int,
    a: float,
    shift: float,
    cache: Any = None,
) -> Tensor:
    """log pi(x_{k*+1} | x_{k*}) under the current weights (recompute_mean_std's path)."""
    mu, std = recompute_mean_std(policy, obs, x_k, k_star, K, a, shift, cache)
    return gaussian_log_prob(x_next, mu, std)


def gaussian_kl(mu: Tensor, mu_ref: Tensor, std: Tensor) -> Tensor:
    """KL(N(mu, std^2) || N(mu_ref, std^2)) summed over every dim but the first: [B].

    Both SDE steps share x_k, sigma and so std; the KL is sum (mu - mu_ref)^2 / (2 std^2)
    (Flow-GRPO's velocity-space KL). Unlike mean(log pi - log pi_ref) on samples of pi_old,
    its gradient pulls mu toward mu_ref.
    """
    d = (mu.float() - mu_ref.float()) / std.float()
    return 0.5 * (d**2).flatten(1).sum(1)


def logp_sensitivity(K: int, a: float, shift: float) -> Tensor:
    """[K] |d log pi / d v| per unit of velocity error and of noise xi, for each SDE step k.

    d mu / d v = -Delta (1 + g^2 (1 - sigma) / (2 sigma)) = -Delta (1 + a^2 / 2), and
    log pi = -|x_{k+1} - mu|^2 / (2 std^2) + const with x_{k+1} - mu = std xi, so
    d log pi / d v = xi Delta (1 + a^2/2) / std = xi sqrt(Delta) (1 + a^2/2) / g_k.
    The same velocity error moves log pi (and a KL by the square) this much more at step k:
    ~24x from k = 1 to k = 7 at K = 8, s = 5. Entry 0 (sigma = 1, g infinite) is 0.
    """
    sig = sigma_schedule(K, shift).double()
    s, delta = sig[:-1], sig[:-1] - sig[1:]
    g = a * torch.sqrt(s / (1.0 - s).clamp_min(1e-300))
    out = torch.sqrt(delta) * (1.0 + a * a / 2.0) / g
    out[0] = 0.0
    return out


def step_weights(K: int, a: float, shift: float, high: int | None = None) -> Tensor:
    """[K] per-k* weights of the policy loss that equalise its score noise across steps:
    w_k = 1 / logp_sensitivity_k, scaled to mean 1 over k* in 1..high (entry 0 is 0).

    The score d log pi / d v = xi c_k (logp_sensitivity) has noise ~ c_k, while its signal,
    E[A xi c_k], goes through the action's response to the injected noise std_k xi, ~ c_k
    std_k = Delta_k (1 + a^2/2): per-step SNR ~ std_k, so the late steps' large, noisy
    scores dominate an unweighted gradient (measured: scripts/grad_snr.py, docs/rl_gpu.md).
    """
    low, high = kstar_bounds(K, 1, high)
    c = logp_sensitivity(K, a, shift)
    w = torch.zeros(K, dtype=torch.float64)
    w[low : high + 1] = 1.0 / c[low : high + 1]
    return (w / w[low : high + 1].mean()).float()


def _bcast(t: Tensor, like: Tensor) -> Tensor:
    """[B] (or scalar) -> broadcastable against like [B, ...]."""
    t = torch.as_tensor(t, device=like.device)
    return t.reshape(t.shape + (1,) * (like.dim() - t.dim())) if t.dim() else t


def _device_of(policy: Policy) -> torch.device:
    try:
        return next(policy.parameters()).device
    except StopIteration:
        return torch.device("cpu")
