"""The weight average of a run's policies (Polyak-Ruppert averaging), as a policy to evaluate.

    mkdir -p COPY_RUN/.wamrl && cp RUN_DIR/.wamrl/config.yaml COPY_RUN/.wamrl/
    python scripts/average_policies.py RUN_DIR --iters 1-8 --out COPY_RUN/iter_108/policy
    wamrl eval --iter 108 --run-dir COPY_RUN

(A copy run, so the run's own status and report do not take the average for iteration 108.)

Why: eval rises, then falls (data/rl_ketchup_cpu/recipe: 0.175 -> 0.450 at policy 5 ->
0.075), every update bounded (KL ~0.01). Averaging the iterates (Polyak-Ruppert) is the
textbook remedy for a noisy stochastic approximation; there, the average of policies 1-8 scored
0.388 against policy 8's 0.125 (80 episodes), but that of 5-8 only 0.200: the updates ran along
a straight line (Adam's momentum), and the average of 1-N lands near policy N/2: near the
peak by the path's shape, not by averaging noise away. A measurement tool, not a cure.
Updates this small leave the policies close enough to average as one model. Every
floating-point tensor is the mean (weights: --ema, else uniform) of the listed policies', in
float64, cast back; the context and stats are the last policy's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from wamrl import paths
from wamrl.policy import load_policy
from wamrl.policy.checkpoint import write_policy_dir


def parse_iters(spec: str) -> list[int]:
    """'1-8' -> [1..8]; '2,4,6' -> [2, 4, 6]; ranges and lists combine ('1-3,8')."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise ValueError(f"--iters {spec!r}: give distinct iterations >= 0, e.g. 1-8")
    return out


def average_weights(n: int, ema: float | None) -> list[float]:
    """Weights of n iterates, oldest first: uniform, or an EMA's (ema^(n-1-i) (1 - ema), with
    the oldest taking the rest so they sum to 1: the EMA started at the first iterate)."""
    if ema is None:
        return [1.0 / n] * n
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"--ema {ema}: needs 0 <= ema < 1")
    w = [ema ** (n - 1 - i) * (1.0 - ema) for i in range(n)]
    w[0] = ema ** (n - 1)
    return w


def average_state(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict:
    """The weighted mean of each floating-point tensor (float64 sums); other tensors (integer
    buffers) must agree across states and are kept."""
    out = {}
    for name, first in states[0].items():
        if not first.is_floating_point():
            if any(not torch.equal(s[name], first) for s in states[1:]):
                raise ValueError(f"non-float tensor {name} differs between the policies")
            out[name] = first
            continue
        acc = sum(w * s[name].double() for w, s in zip(weights, states, strict=True))
        out[name] = acc.to(first.dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--iters", required=True, help="policies to average, e.g. 1-8")
    ap.add_argument("--out", type=Path, required=True, help="the policy directory to write")
    ap.add_argument("--ema", type=float, default=None, help="EMA weights instead of uniform")
    args = ap.parse_args()
    iters = parse_iters(args.iters)
    weights = average_weights(len(iters), args.ema)
    dirs = [paths.policy_dir(args.run_dir, n) for n in iters]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise SystemExit(f"average_policies: no policy at {', '.join(missing)}")
    if args.out.exists():
        raise SystemExit(f"average_policies: {args.out} exists; choose a new directory")
    policies = [load_policy(d) for d in dirs]
    states = [p.state_dict() for p in policies]
    last = policies[-1]
    last.load_state_dict(average_state(states, weights))
    write_policy_dir(
        args.out,
        last,
        dirs[-1] / paths.CONTEXT_FILE,
        dirs[-1] / paths.STATS_FILE,
        {
            "iteration": iters[-1],
            "averaged": {"run": str(args.run_dir), "iterations": iters, "weights": weights},
        },
    )
    print(f"{args.out}: average of policies {iters} (weights {[round(w, 4) for w in weights]})")


if __name__ == "__main__":
    main()
