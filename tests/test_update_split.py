"""scripts/update_split.py's pieces: the --from/--to halves (one policy's actor and
world-model tensors, by name, that move another policy's two halves and nothing else) and
the chain with one policy's velocity at chosen steps, against x_K = x_0 + sum v_k dsigma_k."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from tests.helpers import make_tiny_policy

_spec = importlib.util.spec_from_file_location(
    "update_split", Path(__file__).parents[1] / "scripts" / "update_split.py"
)
update_split = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(update_split)


def test_policy_halves_carry_each_group_and_nothing_else() -> None:
    src, dst = make_tiny_policy(), make_tiny_policy()
    with torch.no_grad():
        for p in dst.parameters():
            p.add_(1.0)  # every tensor of dst differs from src's
    halves = update_split.policy_halves(dst)
    groups = dst.parameter_groups()
    assert set(halves) == set(groups)
    for group, params in groups.items():
        assert len(halves[group]) == len(params)
    before = {k: v.clone() for k, v in src.state_dict().items()}
    src.load_state_dict(halves["world_model"], strict=False)
    after = src.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == set(halves["world_model"])  # the LoRA moved; the actor did not
    assert all("lora" in k for k in changed)
    assert not changed & set(halves["actor"])


class _Constant:
    """A velocity field that is c everywhere (a test double for the chain's arithmetic)."""

    def __init__(self, c: float) -> None:
        self.c = c

    def velocity(self, cache: object, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x, self.c)


def test_swapping_one_step_moves_the_chunk_by_that_steps_velocity_times_its_size() -> None:
    from wamrl.sampler import sigma_schedule

    K, shift = 8, 5.0
    sigmas = sigma_schedule(K, shift)
    x0 = torch.randn(3, 32, 7, generator=torch.Generator().manual_seed(0))
    old, new = _Constant(0.0), _Constant(0.5)
    for step in (0, 3, K - 1):
        x = update_split.ode_chain_swapped(old, new, (None, None), x0, K, shift,
                                           lambda k, s=step: k == s)  # fmt: skip
        # x_K = x_0 + sum_k v_k (sigma_{k+1} - sigma_k): only step `step` has v = 0.5
        expected = x0 + 0.5 * (sigmas[step + 1] - sigmas[step])
        torch.testing.assert_close(x, expected)


def test_swapped_chain_is_the_old_or_the_new_policys_ode_chunk() -> None:
    from tests.helpers import make_obs
    from wamrl.sampler import sample_chunk

    old, new = make_tiny_policy().eval(), make_tiny_policy(perturb="sharp").eval()
    obs = make_obs()
    caches = (old.prefill(obs), new.prefill(obs))
    x0 = torch.randn(2, 32, 7, generator=torch.Generator().manual_seed(1))
    ends = []
    for policy, swap in ((old, lambda k: False), (new, lambda k: True)):
        x = update_split.ode_chain_swapped(old, new, caches, x0, 8, 5.0, swap)
        want = sample_chunk(policy, policy.prefill(obs), 2, 8, 0.0, 5.0, None, x0=x0).chain[:, -1]
        torch.testing.assert_close(x, want)
        ends.append(x)
    mixed = update_split.ode_chain_swapped(old, new, caches, x0, 8, 5.0, lambda k: k == 7)
    assert not torch.allclose(mixed, ends[0]) and not torch.allclose(mixed, ends[1])
