"""Do successive actor updates point the same way?

    python scripts/update_cosine.py RUN_DIR [--from N] [--to M] [--gradient] [--json OUT]

The actor's change in iteration n is d_n = theta_n - theta_{n-1}, the difference of the action
expert's tensors in iter_n/actor/ and iter_{n-1}/actor/ (iter_000: the base's, from
iter_000/policy). Prints, for n = from+1..to, the cosine between d_n and d_{n-1}, and each
|d_n|. Two iterations' gradients come from independent episodes, so where they are mostly
noise (scripts/grad_snr.py: two halves of one iteration agree at cosine ~0.2) a cosine near
1 between successive updates is Adam's momentum (actor.beta1), carried from one iteration to
the next, not the data: with one or two steps per iteration, beta1 = 0.9 makes most of
every update the earlier iterations' gradients (data/rl_ketchup_cpu).

--gradient (needs each iteration's rollouts and policy n-1) also compares d_n with the step
iteration n's own data asks for: p_n = g_n / (sqrt(v_hat) + eps), g_n the gradient of the
PPO surrogate at ratio 1 (mean of step-weighted A log pi over the kept steps; the reference
KL left out) at policy n-1, v_hat Adam's bias-corrected second moment before the update
(sign(g_n) without one: Adam's first step). cos(d_n, p_n) < 0 while successive updates agree
is momentum carrying the policy where its fresh data no longer points (overshoot).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
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


def precondition(g: Tensor, exp_avg_sq: Tensor | None, step: float, beta2: float = 0.999,
                 eps: float = 1e-8) -> Tensor:  # fmt: skip
    """Adam's elementwise scaling of a fresh gradient: g / (sqrt(v / (1 - beta2^t)) + eps),
    or sign(g) (m_hat / sqrt(v_hat) of a first step) where there is no state yet."""
    if exp_avg_sq is None or step == 0:
        return torch.sign(g)
    return g / ((exp_avg_sq / (1.0 - beta2**step)).sqrt() + eps)


def fresh_direction(run: Path, n: int, names: list[str], batch: int = 64) -> tuple[Tensor, Tensor]:
    """(p_n, g_n) of the module docstring, flattened in `names` order (float64)."""
    from wamrl import sampler
    from wamrl.policy import load_policy
    from wamrl.ppo import _transition, load_iteration

    cfg, _, data = load_iteration(run, n)
    policy = load_policy(paths.policy_dir(run, n - 1), device="cpu")
    named = dict(policy.named_parameters())
    for p in policy.parameters():
        p.requires_grad_(False)
    params = [named[k].requires_grad_(True) for k in names]
    weight = torch.ones(data.K)
    if cfg["actor"].get("step_weight", "none") == "inv_sensitivity":
        kmax = cfg["sampler"].get("kstar_max")
        weight = sampler.step_weights(data.K, data.noise_a, data.shift, kmax)
    grads = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for start in range(0, len(data), batch):
        idx = np.arange(start, min(start + batch, len(data)))
        mu, std = _transition(policy, data, idx, "cpu")
        logp = sampler.gaussian_log_prob(data.tensor("x_next", idx, "cpu").float(), mu, std)
        w = weight[data.tensor("k_star", idx, "cpu")] * data.tensor("adv", idx, "cpu").float()
        for acc, g in zip(grads, torch.autograd.grad((w * logp).sum() / len(data), params),
                          strict=True):  # fmt: skip
            acc += g.double()
    g = torch.cat([x.flatten() for x in grads])
    state = paths.actor_dir(run, n - 1) / paths.OPTIMIZER_FILE
    if n == 1 or not state.exists():
        return precondition(g, None, 0), g
    adam = load_tensors(state, "Adam state")
    v = torch.cat([adam[f"{k}.exp_avg_sq"].flatten().double() for k in names])
    return precondition(g, v, float(adam[f"{names[0]}.step"])), g


def gradient_cosines(run: Path, first: int, last: int) -> dict[str, list]:
    """{"gradient_cosine": [cos(d_n, p_n)], "gradient_cosine_to_previous": [cos(p_n,
    p_{n-1})], "raw_gradient_cosine_to_previous": [cos(g_n, g_{n-1})]} for n = first..last
    (the first entry of the last two: None)."""
    names = sorted(actor_tensors(run, last))
    cos = torch.nn.functional.cosine_similarity
    fresh, raw = {}, {}
    out: dict[str, list] = {
        "gradient_cosine": [],
        "gradient_cosine_to_previous": [],
        "raw_gradient_cosine_to_previous": [],
    }
    for n in range(first, last + 1):
        now, before = (flat(actor_tensors(run, i, names), names) for i in (n, n - 1))
        d = now - before
        fresh[n], raw[n] = fresh_direction(run, n, names)
        out["gradient_cosine"].append(float(cos(d, fresh[n], dim=0)))
        for key, vecs in (("gradient_cosine_to_previous", fresh),
                          ("raw_gradient_cosine_to_previous", raw)):  # fmt: skip
            prev = vecs.get(n - 1)
            out[key].append(None if prev is None else float(cos(vecs[n], prev, dim=0)))
        print(f"iteration {n:3d}  cos(d, p) {out['gradient_cosine'][-1]:+.3f}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--from", dest="first", type=int, default=1)
    p.add_argument("--to", dest="last", type=int, required=True)
    p.add_argument("--gradient", action="store_true", help="also cos(d_n, p_n): see above")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    out = update_cosines(a.run, a.first, a.last)
    if a.gradient:
        out.update(gradient_cosines(a.run, a.first, a.last))
    for n, c, m in zip(out["iterations"], out["cosine_to_previous"], out["norm"], strict=True):
        shown = "-" if c is None else f"{c:+.3f}"
        print(f"iteration {n:3d}  |d| {m:.5f}  cos(d, previous d) {shown}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
