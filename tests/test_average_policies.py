"""scripts/average_policies.py against hand numbers: iterate weights (uniform, EMA), the
weighted mean of every float tensor, and a written policy that load_policy accepts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import make_tiny_policy
from wamrl import paths
from wamrl.policy import load_policy
from wamrl.policy.checkpoint import write_policy_dir

_spec = importlib.util.spec_from_file_location(
    "average_policies", Path(__file__).parents[1] / "scripts" / "average_policies.py"
)
average_policies = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(average_policies)


def test_iteration_lists() -> None:
    assert average_policies.parse_iters("1-4") == [1, 2, 3, 4]
    assert average_policies.parse_iters("1-2,5") == [1, 2, 5]
    for bad in ("3,3", "4-2", "-1"):
        with pytest.raises(ValueError):
            average_policies.parse_iters(bad)


def test_weights_uniform_and_ema() -> None:
    assert average_policies.average_weights(4, None) == [0.25] * 4
    # EMA 0.5 started at the first of 3 iterates: ((x1 * .5 + x2 * .5) * .5 + x3 * .5)
    assert average_policies.average_weights(3, 0.5) == pytest.approx([0.25, 0.25, 0.5])
    assert sum(average_policies.average_weights(7, 0.8)) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        average_policies.average_weights(3, 1.0)


def test_weighted_mean_of_float_tensors_and_kept_integer_buffers() -> None:
    s1 = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3])}
    s2 = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor([3])}
    out = average_policies.average_state([s1, s2], [0.25, 0.75])
    assert torch.equal(out["w"], torch.tensor([2.5, 5.0])) and torch.equal(out["n"], s1["n"])
    half = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "n": torch.tensor([3])}
    assert average_policies.average_state([half, half], [0.5, 0.5])["w"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="non-float tensor n"):
        average_policies.average_state([s1, {**s2, "n": torch.tensor([4])}], [0.5, 0.5])


def test_writes_the_average_as_a_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = (["task"], torch.zeros(1, 4, 8), torch.ones(1, 4, dtype=torch.bool))
    states = []
    for n, seed in ((1, 0), (2, 1)):
        policy = make_tiny_policy(seed)
        write_policy_dir(paths.policy_dir(tmp_path, n), policy, ctx, {"a": 1}, {"iteration": n})
        states.append(policy.state_dict())
    out = tmp_path / "avg" / "policy"
    argv = ["average_policies.py", str(tmp_path), "--iters", "1-2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    average_policies.main()
    got = load_policy(out).state_dict()  # checks every file against checkpoint.json
    name = next(k for k in got if not torch.equal(states[0][k], states[1][k]))
    assert torch.allclose(got[name], (states[0][name] + states[1][name]) / 2, atol=1e-7)
    with pytest.raises(SystemExit, match="exists"):
        average_policies.main()
