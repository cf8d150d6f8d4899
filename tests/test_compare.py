"""wamrl.compare: two evals' success, unpaired and paired, against the formulas with numbers."""

from __future__ import annotations

import json
import math

import pytest

from wamrl.compare import compare, mcnemar, table, two_proportion_z, why_unpaired


def test_two_proportion_z_by_hand() -> None:
    # 113/200 vs 123/200: pooled p = 236/400, se = sqrt(p (1 - p) (2/200)) = 0.049183
    assert two_proportion_z(113, 200, 123, 200) == pytest.approx(0.05 / 0.0491833, rel=1e-5)
    assert two_proportion_z(123, 200, 113, 200) == pytest.approx(-1.016605, rel=1e-5)
    assert two_proportion_z(0, 20, 0, 20) == 0.0  # no variance, no evidence


def test_mcnemar_exact_tail_and_z() -> None:
    # 20 discordant episodes for B, 10 for A: P(X <= 10 | n = 30, 1/2) = 0.0493686 (tables)
    z, p = mcnemar(20, 10)
    assert z == pytest.approx(10 / math.sqrt(30))
    assert p == pytest.approx(2 * 0.0493686, abs=1e-6)
    assert mcnemar(10, 20) == pytest.approx((-z, p))
    assert mcnemar(5, 0)[1] == pytest.approx(2 / 32)  # five of five: 2 * 0.5^5
    assert mcnemar(3, 3)[1] == 1.0  # capped: the two tails overlap at the middle
    assert mcnemar(0, 0) == (0.0, 1.0)


def _eval(outcomes: dict[str, list[bool]], seed: int = 1234) -> dict:
    return {
        "protocol": {"name": "wamrl", "K": 8},
        "config": {"eval": {"seed": seed}},
        "tasks": {
            name: {"success_rate": sum(o) / len(o), "episodes": len(o), "outcomes": o}
            for name, o in outcomes.items()
        },
    }


def test_compare_pairs_episodes_and_counts_only_discordant_ones() -> None:
    T, F = True, False
    a = _eval({"soup": [T, T, F, F, F], "milk": [T, F, F, F, F]})
    b = _eval({"soup": [T, T, T, T, F], "milk": [F, T, F, F, F]})
    r = compare(a, b)
    assert r["tasks"]["soup"] == {
        "a": 0.4, "b": 0.8, "n_a": 5, "n_b": 5, "z": pytest.approx(two_proportion_z(2, 5, 4, 5)),
        "b_only": 2, "a_only": 0,
    }  # fmt: skip
    assert (r["tasks"]["milk"]["b_only"], r["tasks"]["milk"]["a_only"]) == (1, 1)
    assert (r["a"], r["b"], r["n_a"]) == (0.3, 0.5, 10)
    assert r["z"] == pytest.approx(two_proportion_z(3, 10, 5, 10))
    # 3 discordant for B, 1 for A: p = 2 * (1 + 4) / 16
    assert r["paired"] == {"b_only": 3, "a_only": 1, "z": pytest.approx(1.0), "p": 0.625}
    assert "McNemar" in table(r) and "soup" in table(r)
    json.dumps(r)  # what `wamrl compare --json` prints


def test_compare_falls_back_to_unpaired_and_says_why() -> None:
    a = _eval({"soup": [True, False]})
    assert "eval seeds differ" in why_unpaired(a, _eval({"soup": [True, True]}, seed=1))
    old = _eval({"soup": [True, True]})
    del old["tasks"]["soup"]["outcomes"]
    r = compare(a, old)
    assert r["paired"] is None and "without per-episode outcomes" in r["unpaired_because"]
    assert "not paired" in table(r) and r["b"] == 1.0
    with pytest.raises(ValueError, match="share no task"):
        compare(a, _eval({"milk": [True]}))
