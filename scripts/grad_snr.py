"""Is an iteration's policy gradient signal or noise? Split its groups in two and compare.

    python scripts/grad_snr.py RUN_DIR ITERATION [--splits 4] [--batch 64]

The actor's first step follows g = grad mean(A * log pi) at pi = pi_old (the PPO surrogate's
gradient at ratio 1). This script computes g separately on two disjoint halves of the
iteration's kept groups, for several random splits, and reports the cosine of the two
halves' gradients: near 0 means the halves disagree and a step fits noise, not the advantage
(for a gradient with signal s and per-half noise of variance v, E cos ~ |s|^2 / (|s|^2 + v)).
It also gives each k*'s share of |g|^2 (which denoising step drives the update), and the
same cosines for success-only advantages (the group-normalised success of each episode, β = 0
with no per-step credit), the cosine of one half's stored-advantage gradient with the other
half's success-only one (does the reward point where success on unseen groups does?), and
per k* the share of the action's variance that the SDE step makes (the rest is x_0's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from wamrl import paths, sampler, store
from wamrl.ppo import ActorData, _transition, load_iteration
from wamrl.sampler import logp_sensitivity, sigma_schedule


def episode_tables(shards: list[Path]) -> list[dict[str, np.ndarray]]:
    return [store.read_episode_table(store.open_store(p)) for p in shards]


def group_of(data: ActorData, tables: list[dict[str, np.ndarray]]) -> np.ndarray:
    """A run-wide group id per kept step (shard, the episode's group)."""
    return np.array([w * 10**6 + int(tables[w]["group"][e]) for w, e in data.where[:, :2]])


def success_advantage(data: ActorData, tables: list[dict[str, np.ndarray]], G: int) -> np.ndarray:
    """Each step's episode success, normalised within its group (mean 0, std 1; a store holds
    its episodes group by group, G each, as the rollout plan writes them)."""
    out = np.zeros(len(data))
    for w, table in enumerate(tables):
        z = table["success"].astype(float).reshape(-1, G)
        z = (z - z.mean(1, keepdims=True)) / (z.std(1, keepdims=True) + 1e-6)
        rows = data.where[:, 0] == w
        out[rows] = z.reshape(-1)[data.where[rows, 1]]
    return out


def gradients(policy, data: ActorData, adv: np.ndarray, rows: np.ndarray, batch: int):
    """The flattened grad of sum(A log pi) over `rows`, per k*."""
    params = [p for p in policy.parameter_groups()["actor"] if p.requires_grad]
    total = {}
    for start in range(0, len(rows), batch):
        idx = np.sort(rows[start : start + batch])
        mu, std = _transition(policy, data, idx, "cpu")
        logp = sampler.gaussian_log_prob(data.tensor("x_next", idx, "cpu").float(), mu, std)
        a = torch.from_numpy(adv[idx]).float()
        ks = data.k_star[idx]
        for k in np.unique(ks):
            sel = torch.from_numpy(ks == k)
            grads = torch.autograd.grad((a[sel] * logp[sel]).sum(), params, retain_graph=True)
            flat = torch.cat([g.flatten() for g in grads])
            total[int(k)] = total.get(int(k), 0) + flat
    return total


@torch.no_grad()
def sde_variance_share(
    policy, data: ActorData, a: float, kmax: int, n: int = 64, reps: int = 8
) -> dict[int, float]:
    """Per k*: the share of the final action's variance that the SDE step's noise makes,
    E_x0[Var_xi(action)] / Var_{x0, xi}(action), on the first n stored observations. The rest
    comes from x_0, which the ratio never credits: a small share means most of what the
    advantage responds to is noise the gradient cannot attribute."""
    idx = np.arange(min(n, len(data)))
    cache = policy.prefill(data.obs(idx, "cpu"))
    gen = torch.Generator().manual_seed(0)
    shape = (len(idx), *data.x_k.shape[1:])
    out = {}
    for k in range(1, kmax + 1):
        ks = torch.full((len(idx),), k, dtype=torch.long)

        def final(x0: torch.Tensor, ks: torch.Tensor = ks) -> torch.Tensor:
            res = sampler.sample_chunk(
                policy, cache, len(idx), data.K, a, data.shift, gen, x0=x0, k_star=ks
            )
            return res.chain[:, -1]

        x0 = torch.randn(shape, generator=gen)
        within = torch.stack([final(x0) for _ in range(reps)]).var(0).mean()
        total = torch.stack([final(torch.randn(shape, generator=gen)) for _ in range(reps)])
        out[k] = round(float(within / total.var(0).mean()), 4)
    return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm() + 1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("iteration", type=int)
    ap.add_argument("--splits", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    from wamrl.policy import load_policy

    run, n = args.run_dir, args.iteration
    cfg, shards, data = load_iteration(run, n)
    prev_dir = paths.policy_dir(run, n - 1)
    G = int(cfg["rollout"]["group_size"])
    tables = episode_tables(shards)
    group = group_of(data, tables)
    policy = load_policy(prev_dir, device="cpu").eval()
    advs = {"stored": data.adv.astype(float), "success_only": success_advantage(data, tables, G)}
    result: dict = {"iteration": n, "steps": len(data), "groups": int(np.unique(group).size)}
    kmax = cfg["sampler"].get("kstar_max") or data.K - 1
    result["sde_variance_share"] = {
        f"a={a}": sde_variance_share(policy, data, a, kmax)
        for a in (data.noise_a, 2 * data.noise_a)
    }
    print(json.dumps({"sde_variance_share": result["sde_variance_share"]}), flush=True)
    rng = np.random.default_rng(0)
    c = logp_sensitivity(data.K, data.noise_a, data.shift).numpy()
    sig = sigma_schedule(data.K, data.shift).double().numpy()
    g2 = data.noise_a**2 * sig[:-1] / np.maximum(1.0 - sig[:-1], 1e-300)
    # Per-k* loss weights: none; 1 / c_k (every step's score noise equal); g_k^2 (inverse
    # noise variance x signal ~ Delta_k: the best linear mix if signal ~ Delta_k).
    weightings = {"none": np.ones_like(c), "inv_sensitivity": 1.0 / np.maximum(c, 1e-30), "g2": g2}
    stats = {
        name: {"cos_k": {}, "share": {}, "cos_w": {w: [] for w in weightings}} for name in advs
    }
    # stored on one half against success-only on the other: does the reward's update point
    # where success on unseen groups does?
    cross: dict[str, list[float]] = {w: [] for w in weightings}
    for _ in range(args.splits):
        ids = np.unique(group)
        half = set(rng.permutation(ids)[: len(ids) // 2].tolist())
        in_a = np.array([g in half for g in group])
        grads = {
            name: [
                gradients(policy, data, adv, np.flatnonzero(rows), args.batch)
                for rows in (in_a, ~in_a)
            ]  # fmt: skip
            for name, adv in advs.items()
        }

        def mix(per_k: dict, wk: np.ndarray) -> torch.Tensor:
            return sum(float(wk[k]) * g for k, g in per_k.items())

        for name, (ka, kb) in grads.items():
            st = stats[name]
            for w, wk in weightings.items():
                st["cos_w"][w].append(cosine(mix(ka, wk), mix(kb, wk)))
            whole = sum(ka.values()) + sum(kb.values())
            for k in ka:
                if k in kb:
                    st["cos_k"].setdefault(k, []).append(cosine(ka[k], kb[k]))
                    st["share"].setdefault(k, []).append(
                        float((ka[k] + kb[k]).norm() ** 2 / whole.norm() ** 2)
                    )
        for w, wk in weightings.items():
            (sa, sb), (ua, ub) = grads["stored"], grads["success_only"]
            cross[w].append(
                0.5 * (cosine(mix(sa, wk), mix(ub, wk)) + cosine(mix(sb, wk), mix(ua, wk)))
            )

    def mean(v: list[float]) -> float:
        return round(float(np.mean(v)), 4)

    for name, st in stats.items():
        result[name] = {
            "cos_halves": {w: mean(v) for w, v in st["cos_w"].items()},
            "cos_halves_each": {w: [round(x, 4) for x in v] for w, v in st["cos_w"].items()},
            "cos_halves_by_k_star": {k: mean(v) for k, v in sorted(st["cos_k"].items())},
            "grad_sq_share_by_k_star": {k: mean(v) for k, v in sorted(st["share"].items())},
        }
    result["cos_stored_vs_success_other_half"] = {w: mean(v) for w, v in cross.items()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
