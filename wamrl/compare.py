"""Did the policy get better? Two eval.json files of one protocol, compared.

Unpaired, each rate is binomial: the pooled two-proportion test,
    z = (p_B - p_A) / sqrt(p (1 - p) (1/n_A + 1/n_B)),  p = (k_A + k_B) / (n_A + n_B).
Paired, where both evals carry per-episode `outcomes` (stages/eval.py) and ran one protocol
with one eval seed: episode k of a task starts from the same init state and the same x_0
seed under either policy, so episodes both policies win or both lose say nothing about
which is better, and only the discordant ones count: b = A failed and B succeeded, c = the
reverse. McNemar's test: under "no difference" b ~ Binomial(b + c, 1/2), exact two-sided
    p = min(1, 2 P(X <= min(b, c))),  and  z = (b - c) / sqrt(b + c).
When most episodes agree, the paired test sees a change the unpaired one calls noise.
"""

from __future__ import annotations

import math
from typing import Any


def two_proportion_z(k_a: int, n_a: int, k_b: int, n_b: int) -> float:
    """Pooled z of rate B minus rate A; 0 where both are 0 % or both 100 %."""
    p = (k_a + k_b) / (n_a + n_b)
    se = math.sqrt(p * (1 - p) * (1 / n_a + 1 / n_b))
    return (k_b / n_b - k_a / n_a) / se if se > 0 else 0.0


def mcnemar(b: int, c: int) -> tuple[float, float]:
    """(z, exact two-sided p) of b discordant episodes for B against c for A."""
    n = b + c
    if n == 0:
        return 0.0, 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return (b - c) / math.sqrt(n), min(1.0, 2 * tail)


def why_unpaired(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """Why two evals' episodes do not pair one to one; None where they do."""
    if a.get("protocol") != b.get("protocol"):
        return "the protocols differ"
    seed_a, seed_b = (r.get("config", {}).get("eval", {}).get("seed") for r in (a, b))
    if seed_a != seed_b:
        return f"the eval seeds differ ({seed_a} vs {seed_b})"
    for name in a["tasks"].keys() & b["tasks"].keys():
        if "outcomes" not in a["tasks"][name] or "outcomes" not in b["tasks"][name]:
            return "an eval.json without per-episode outcomes (written before they were kept)"
    return None


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per task and over the tasks both evals scored: rates, unpaired z and, where the
    episodes pair, McNemar's b, c, z and p (paired over a task's first min(n_A, n_B))."""
    names = [n for n in a["tasks"] if n in b["tasks"]]
    if not names:
        raise ValueError("the two evals share no task")
    unpaired = why_unpaired(a, b)
    tasks: dict[str, Any] = {}
    tot = {"k_a": 0, "n_a": 0, "k_b": 0, "n_b": 0, "b": 0, "c": 0}
    for name in names:
        ta, tb = a["tasks"][name], b["tasks"][name]
        n_a, n_b = int(ta["episodes"]), int(tb["episodes"])
        k_a, k_b = round(ta["success_rate"] * n_a), round(tb["success_rate"] * n_b)
        row: dict[str, Any] = {"a": k_a / n_a, "b": k_b / n_b, "n_a": n_a, "n_b": n_b}
        row["z"] = two_proportion_z(k_a, n_a, k_b, n_b)
        if unpaired is None:
            pairs = list(zip(ta["outcomes"], tb["outcomes"], strict=False))
            row["b_only"] = sum(1 for x, y in pairs if y and not x)
            row["a_only"] = sum(1 for x, y in pairs if x and not y)
            tot["b"] += row["b_only"]
            tot["c"] += row["a_only"]
        tasks[name] = row
        for key, v in (("k_a", k_a), ("n_a", n_a), ("k_b", k_b), ("n_b", n_b)):
            tot[key] += v
    out: dict[str, Any] = {
        "tasks": tasks,
        "a": tot["k_a"] / tot["n_a"],
        "b": tot["k_b"] / tot["n_b"],
        "n_a": tot["n_a"],
        "n_b": tot["n_b"],
        "z": two_proportion_z(tot["k_a"], tot["n_a"], tot["k_b"], tot["n_b"]),
        "paired": None,
        "unpaired_because": unpaired,
    }
    if unpaired is None:
        z, p = mcnemar(tot["b"], tot["c"])
        out["paired"] = {"b_only": tot["b"], "a_only": tot["c"], "z": z, "p": p}
    return out


def table(result: dict[str, Any], label_a: str = "A", label_b: str = "B") -> str:
    """The comparison as text: one row per task, then all tasks."""
    paired = result["paired"] is not None
    head = f"{'task':<52}{label_a[:9]:>10}{label_b[:9]:>10}{'z':>7}"
    lines = [head + (f"{'B only':>8}{'A only':>8}" if paired else "")]
    for name, r in result["tasks"].items():
        line = f"{name[:51]:<52}{r['a']:>10.3f}{r['b']:>10.3f}{r['z']:>7.2f}"
        lines.append(line + (f"{r['b_only']:>8}{r['a_only']:>8}" if paired else ""))
    lines.append(
        f"{'all (' + str(result['n_a']) + ' vs ' + str(result['n_b']) + ' episodes)':<52}"
        f"{result['a']:>10.3f}{result['b']:>10.3f}{result['z']:>7.2f}"
    )
    if paired:
        p = result["paired"]
        lines.append(
            f"paired (McNemar): {p['b_only']} episodes only B won, {p['a_only']} only A won: "
            f"z = {p['z']:.2f}, exact two-sided p = {p['p']:.3g}"
        )
    else:
        lines.append(f"not paired: {result['unpaired_because']}")
    return "\n".join(lines)
