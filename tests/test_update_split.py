"""scripts/update_split.py's --from/--to halves: the actor and world-model tensors of one
policy, by name, that move another policy's two halves and nothing else."""

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
