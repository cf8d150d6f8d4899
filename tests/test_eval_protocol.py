"""eval.protocol: `official` resolves to Fast-WAM's own LIBERO eval loop, `wamrl` to the seed's.

The official loop (experiments/libero/eval_libero_single.py, FastWAM.infer_action at 45d8e14),
as reimplemented here: every query calls infer_action(num_inference_steps=10, seed=42), which
draws its latents with torch.randn((1, 32, 7), generator=torch.Generator().manual_seed(42)),
casts them to the model dtype, and steps latents = latents + v * delta over the deltas of
phi(linspace(1, 0, K + 1)) in float32, cast to the model dtype. tests/test_fastwam.py holds the
same against the official package where it is installed.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from stages.eval import Protocol, episode_noise, reference_rates, resolve_protocol, success_table
from wamrl.config import DEFAULT_CONFIG, ConfigError, load_config
from wamrl.envs.tasks import load_tasks
from wamrl.plan import EpisodeSpec
from wamrl.rollout import _episode_noise, _Running
from wamrl.sampler import official_sigmas, sample_chunk, sigma_schedule

FASTWAM = DEFAULT_CONFIG.parent / "fastwam.yaml"


def _eval_noise(ep: _Running) -> Tensor:
    """x_0 of an eval episode's next query (a = 0: no k*, no SDE noise drawn)."""
    x0, k_star, xi = _episode_noise(ep, 20, 0.0)
    assert k_star == 0 and not xi.any()
    return x0


def official_x0() -> Tensor:
    """infer_action's initial latents for seed 42 (before the cast to the model dtype)."""
    return torch.randn((1, 32, 7), generator=torch.Generator().manual_seed(42), dtype=torch.float32)


def test_wamrl_protocol_keeps_the_seed_protocol() -> None:
    p = resolve_protocol(load_config())
    assert p == Protocol("wamrl", 20, "per_episode", False, 1, None, "float32")
    cfg = load_config(overrides={"eval.K": 8, "eval.max_macro_steps": 3, "env.msaa": True})
    assert resolve_protocol(cfg) == Protocol("wamrl", 8, "per_episode", True, 1, 3, "float32")


def test_official_protocol_fixes_fastwams_eval_settings() -> None:
    over = {"eval.protocol": "official", "eval.K": 20, "eval.max_macro_steps": 3}
    p = resolve_protocol(load_config([FASTWAM], over))
    assert p == Protocol("official", 10, "reseed_42", True, 50, None, "bfloat16")
    # the release in float32: the official loop then steps in float32 too
    p32 = resolve_protocol(load_config([FASTWAM], {**over, "policy.fastwam.dtype": "float32"}))
    assert p32.scheduler_dtype == "float32"
    # the tiny backend holds float32 weights: its scheduler stays float32
    assert resolve_protocol(load_config(overrides=over)).scheduler_dtype == "float32"


def running(protocol: Protocol, task: int, k: int) -> _Running:
    """An eval episode as run_episodes starts it (stages/eval.py's seeds, rollout's generator)."""
    t = load_tasks()[task]
    seed, reseed = episode_noise(protocol, 1234, task, k)
    return _Running(
        0, EpisodeSpec(t, k, task, False, seed, reseed), torch.Generator().manual_seed(seed)
    )


def test_official_noise_is_seed_42_at_every_query() -> None:
    official = resolve_protocol(load_config(overrides={"eval.protocol": "official"}))
    ref = official_x0()[0]
    eps = [running(official, 21, 0), running(official, 27, 3)]
    for ep in eps:
        for _query in range(3):  # every query of every episode starts from the same x_0
            assert torch.equal(_eval_noise(ep), ref)


def test_wamrl_noise_is_fresh_per_query_and_reproducible_per_episode() -> None:
    wamrl = resolve_protocol(load_config())
    a, b = running(wamrl, 21, 0), running(wamrl, 21, 0)
    first, second = _eval_noise(a), _eval_noise(a)
    assert not torch.equal(first, second)  # the episode's generator moves on
    assert torch.equal(first, _eval_noise(b)) and torch.equal(second, _eval_noise(b))
    assert not torch.equal(first, _eval_noise(running(wamrl, 21, 1)))  # another episode


def test_rollout_noise_is_drawn_per_episode() -> None:
    """a > 0: x_0, k* and the SDE noise of a query come from the episode's own generator, in
    that order; the same seed gives the same numbers whatever else was drawn meanwhile."""
    wamrl = resolve_protocol(load_config())
    a, b = running(wamrl, 21, 0), running(wamrl, 21, 0)
    first = _episode_noise(a, 8, 0.5)
    _episode_noise(running(wamrl, 27, 3), 8, 0.5)  # another episode's query in between
    again = _episode_noise(b, 8, 0.5)
    assert 1 <= first[1] <= 7 and first[1] == again[1]
    assert torch.equal(first[0], again[0]) and torch.equal(first[2], again[2])
    g = torch.Generator().manual_seed(a.spec.noise_seed)  # the order: x_0, k*, xi
    x0 = torch.randn(32, 7, generator=g)
    k = int(torch.randint(1, 8, (1,), generator=g))
    assert torch.equal(first[0], x0) and first[1] == k
    assert torch.equal(first[2], torch.randn(32, 7, generator=g))


def test_official_sigma_schedule_at_k10() -> None:
    """sigma_k = 5u / (1 + 4u), u = 1 - k/10: by hand at k = 0, 1, 5, 9, 10."""
    s = official_sigmas(10, 5.0)
    assert s.dtype == torch.float32 and s.shape == (11,)
    hand = {0: 1.0, 1: 4.5 / 4.6, 5: 2.5 / 3.0, 9: 0.5 / 1.4, 10: 0.0}
    for k, v in hand.items():
        assert float(s[k]) == pytest.approx(v, abs=1e-7)
    # our float64-computed schedule agrees to float32 rounding
    torch.testing.assert_close(s, sigma_schedule(10, 5.0), rtol=0, atol=1.2e-7)


class LinearVelocity(nn.Module):
    """v(x, sigma) = 0.7 x - sigma, returned in x's dtype (as the bf16 model does)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("one", torch.ones(()))

    def velocity(self, cache, x: Tensor, sigma: Tensor) -> Tensor:
        return (0.7 * x.float() - sigma[:, None, None]).to(x.dtype)


def official_loop(model: LinearVelocity, K: int, dtype: torch.dtype) -> Tensor:
    """FastWAM.infer_action's latents loop with build_inference_schedule's timesteps/deltas."""
    u = torch.linspace(1.0, 0.0, K + 1, dtype=torch.float32)
    sigma = 5.0 * u / (1.0 + 4.0 * u)
    deltas = (sigma[1:] - sigma[:-1]).to(dtype)
    latents = official_x0().to(dtype)
    for k in range(K):
        pred = model.velocity(None, latents, sigma[k].reshape(1))
        latents = latents + pred * deltas[k]  # WanContinuousFlowMatchScheduler.step
    return latents.float()


def test_bf16_scheduler_is_the_official_loop() -> None:
    model = LinearVelocity()
    x0 = official_x0()
    bf16 = sample_chunk(model, None, 1, 10, 0.0, 5.0, None, x0=x0, scheduler_dtype=torch.bfloat16)
    assert torch.equal(bf16.chain[:, -1], official_loop(model, 10, torch.bfloat16))
    f32 = sample_chunk(model, None, 1, 10, 0.0, 5.0, None, x0=x0)
    torch.testing.assert_close(f32.chain[:, -1], official_loop(model, 10, torch.float32))
    assert not torch.equal(bf16.chain[:, -1], f32.chain[:, -1])  # bf16 steps do round
    with pytest.raises(ValueError, match="needs a = 0"):  # log pi stays float32
        sample_chunk(model, None, 1, 10, 0.5, 5.0, None, x0=x0, scheduler_dtype=torch.bfloat16)


def test_first_run_table_shows_the_base_rates_beside() -> None:
    cfg = load_config()
    tasks = [t for t in load_tasks() if t.index in cfg["eval"]["tasks"]]
    ref = reference_rates(cfg, tasks)
    assert ref is not None and ref["episodes_per_task"] == 10
    assert set(ref["tasks"]) == {t.name for t in tasks}
    assert reference_rates(load_config([FASTWAM]), tasks) is None  # no base eval.json there
    report = {
        "episodes_per_task": 1,
        "tasks": {t.name: {"suite": t.suite, "success_rate": 1.0} for t in tasks},
        "average": 1.0,
        "protocol": {"name": "wamrl", "K": 20, "max_macro_steps": None},
        "reference": ref,
    }
    table = success_table(report)
    for t in tasks:
        assert f"{ref['tasks'][t.name]:.2f}" in table.split(t.name[:50])[1].splitlines()[0]
    assert "full step budgets" in table and "data/base_policy/eval.json" in table


def test_kstar_max_bounds_the_rollout_sde_step() -> None:
    """sampler.kstar_max: k* ~ U{1..kstar_max}, drawn in the same place of the episode's
    stream, so x_0 stays the same number and only k* (and what follows it) changes."""
    wamrl = resolve_protocol(load_config())
    seen = {_episode_noise(running(wamrl, t, k), 8, 0.5, 6)[1] for t in range(40) for k in (0, 1)}
    assert seen == set(range(1, 7))  # 80 draws: every step but the last, never 7
    default, capped = (_episode_noise(running(wamrl, 21, 0), 8, 0.5, m) for m in (None, 6))
    assert torch.equal(default[0], capped[0])
    g = torch.Generator().manual_seed(running(wamrl, 21, 0).spec.noise_seed)
    torch.randn(32, 7, generator=g)
    assert capped[1] == int(torch.randint(1, 7, (1,), generator=g))
    with pytest.raises(ConfigError, match="kstar_max: 8 exceeds K - 1 = 7"):
        load_config(overrides={"sampler.kstar_max": 8})
