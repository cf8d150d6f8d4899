"""Do successive actor updates point the same way?

    python scripts/update_cosine.py RUN_DIR [--from N] [--to M] [--json OUT]

The actor's change in iteration n is d_n = theta_n - theta_{n-1}, the difference of the action
expert's tensors in iter_n/actor/ and iter_{n-1}/actor/ (iter_000: the base's, from
iter_000/policy). Prints, for n = from+1..to, the cosine between d_n and d_{n-1}, and each
|d_n|. Two iterations' gradients come from independent episodes, so where they are mostly
noise (scripts/grad_snr.py: two halves of one iteration agree at cosine ~0.2) a cosine near
1 between successive updates is Adam's momentum (actor.beta1), carried from one iteration to
the next, not the data: with one or two steps per iteration, beta1 = 0.9 makes most of
every update the earlier iterations' gradients (data/rl_ketchup_cpu).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor

from wamrl import paths
from wamrl.artifact import load_tensors


def actor_tensors(run: Path, iteration: int, names: list[str] | None = None) -> dict[str, Tensor]:
    """The action expert's tensors after `iteration` (0: the base policy's, by name)."""
    if iteration > 0:
        return load_tensors(paths.actor_dir(run, iteration) / paths.ACTOR_FILE, "actor tensors")
    model = load_tensors(paths.policy_dir(run, 0) / paths.MODEL_FILE, "base policy")
    if names is None or not set(names) <= set(model):
        raise ValueError(f"{paths.policy_dir(run, 0)}: the base lacks the actor's tensors")
    return {n: model[n] for n in names}


def flat(t: dict[str, Tensor], names: list[str]) -> Tensor:
    return torch.cat([t[n].flatten().double() for n in names])


def update_cosines(run: Path, first: int, last: int) -> dict[str, list]:
    """{"iterations": [n], "cosine_to_previous": [cos(d_n, d_{n-1})], "norm": [|d_n|]} for
    n = first..last (first >= 1; the first entry's cosine is None: no d_{first-1} read)."""
    if not 1 <= first < last:
        raise ValueError(f"need 1 <= --from < --to, got {first}, {last}")
    names = sorted(actor_tensors(run, last))
    theta = {n: flat(actor_tensors(run, n, names), names) for n in range(first - 1, last + 1)}
    deltas = {n: theta[n] - theta[n - 1] for n in range(first, last + 1)}
    cos: list[float | None] = [None] + [
        float(torch.nn.functional.cosine_similarity(deltas[n], deltas[n - 1], dim=0))
        for n in range(first + 1, last + 1)
    ]
    return {
        "iterations": list(range(first, last + 1)),
        "cosine_to_previous": cos,
        "norm": [float(deltas[n].norm()) for n in range(first, last + 1)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--from", dest="first", type=int, default=1)
    p.add_argument("--to", dest="last", type=int, required=True)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    out = update_cosines(a.run, a.first, a.last)
    for n, c, m in zip(out["iterations"], out["cosine_to_previous"], out["norm"], strict=True):
        shown = "-" if c is None else f"{c:+.3f}"
        print(f"iteration {n:3d}  |d| {m:.5f}  cos(d, previous d) {shown}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
