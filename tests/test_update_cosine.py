"""scripts/update_cosine.py against hand numbers: successive actor updates, from the base's
tensors to iter_n/actor/, and their cosines."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wamrl import paths

_spec = importlib.util.spec_from_file_location(
    "update_cosine", Path(__file__).parents[1] / "scripts" / "update_cosine.py"
)
update_cosine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(update_cosine)


def _run(tmp_path: Path, thetas: list[list[float]]) -> Path:
    """A run dir whose actor tensor `a` (2 entries) and `b` (1) are thetas[n] after n."""
    base = paths.policy_dir(tmp_path, 0)
    base.mkdir(parents=True)
    t0 = torch.tensor(thetas[0])
    save_file({"a": t0[:2], "b": t0[2:], "video.w": torch.ones(3)}, base / paths.MODEL_FILE)
    for n, theta in enumerate(thetas[1:], start=1):
        d = paths.actor_dir(tmp_path, n)
        d.mkdir(parents=True)
        t = torch.tensor(theta)
        save_file({"a": t[:2], "b": t[2:]}, d / paths.ACTOR_FILE)
    return tmp_path


def test_cosines_and_norms_of_successive_updates(tmp_path: Path) -> None:
    # d_1 = (1, 0, 0), d_2 = (1, 1, 0), d_3 = (-1, -1, 0)
    run = _run(tmp_path, [[0, 0, 0], [1, 0, 0], [2, 1, 0], [1, 0, 0]])
    out = update_cosine.update_cosines(run, 1, 3)
    assert out["iterations"] == [1, 2, 3]
    assert out["cosine_to_previous"][0] is None
    assert out["cosine_to_previous"][1:] == pytest.approx([1 / math.sqrt(2), -1.0])
    assert out["norm"] == pytest.approx([1.0, math.sqrt(2), math.sqrt(2)])
    assert update_cosine.update_cosines(run, 2, 3)["cosine_to_previous"][1] == pytest.approx(-1)


def test_a_bad_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--from"):
        update_cosine.update_cosines(tmp_path, 0, 3)


def test_precondition_is_adams_scaling_of_a_fresh_gradient() -> None:
    g = torch.tensor([0.3, -0.2, 0.0], dtype=torch.float64)
    # no state: a first Adam step, m_hat / sqrt(v_hat) = g / |g|
    assert update_cosine.precondition(g, None, 0).tolist() == [1.0, -1.0, 0.0]
    # v = (0.04, 0.01, 0) after t = 10 steps: v_hat = v / (1 - 0.999^10)
    v = torch.tensor([0.04, 0.01, 0.0], dtype=torch.float64)
    c = 1.0 - 0.999**10
    got = update_cosine.precondition(g, v, 10.0)
    want = [0.3 / (math.sqrt(0.04 / c) + 1e-8), -0.2 / (math.sqrt(0.01 / c) + 1e-8), 0.0]
    assert got.tolist() == pytest.approx(want, rel=1e-12)
