"""Which half of an iteration's update moved the policy: the actor's or the world model's?

    python scripts/update_split.py RUN_DIR ITERATION [--steps 512]
    python scripts/update_split.py RUN_DIR ITERATION --from POLICY_DIR --to POLICY_DIR

Merge puts two updates into iter_n/policy: the action expert (actor stage, trained with
iter_{n-1}'s video expert and held to actor.target_kl) and the video expert's LoRA (world-model
stage, no trust region on the action). The actor reaches the video expert's features through
the first-frame cache, so a LoRA step moves the action distribution too, unmeasured. This
script measures both on iteration n's own kept steps (what the actor trained on): the exact
KL of the SDE step, sum (mu - mu_{n-1})^2 / (2 std^2) (sampler.gaussian_kl, the actor
metrics' `kl`), from policy n-1 to (a) n-1 + the actor tensors, (b) n-1 + the LoRA
tensors, (c) policy n, overall and per k*; and what eval sees: the RMS change of the
deterministic action chunk (a = 0, the rollout's K, the same x_0 per step), in normalised
action units (min/max-normalised to [-1, 1]). `both` also splits that change by denoising
step (`action_rms_change_by_step`): the chain run with the new policy at step k alone, the
old one at every other step. The deterministic steps (k = 0 and, with sampler.kstar_max,
the last) show up there and in no KL.

With --from/--to, the same split for the change between any two policies (e.g. the base and
policy 8: what eight iterations of each half did together), measured on iteration n's steps:
the actor and world-model tensors are `to`'s parameter groups, put into `from`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from wamrl import paths
from wamrl.artifact import load_tensors
from wamrl.contract import ACTION_DIM, CHUNK_LEN
from wamrl.policy.base import Policy
from wamrl.ppo import learner_pass, load_iteration
from wamrl.sampler import gaussian_kl, ode_step, sample_chunk, sigma_schedule


def policy_halves(policy: Policy) -> dict[str, dict[str, torch.Tensor]]:
    """The policy's trainable tensors by parameter group (actor, world_model), by name."""
    names = {id(p): name for name, p in policy.named_parameters()}
    return {
        group: {names[id(p)]: p.detach().clone() for p in params}
        for group, params in policy.parameter_groups().items()
    }


def chunk_noise(start: int, n: int) -> Tensor:
    """x_0 of the batch of steps from `start` on: the same for every policy measured."""
    return torch.randn(n, CHUNK_LEN, ACTION_DIM, generator=torch.Generator().manual_seed(start))


@torch.no_grad()
def ode_chain_swapped(
    old: Policy,
    new: Policy,
    caches: tuple[Any, Any],
    x0: Tensor,
    K: int,
    shift: float,
    swap: Callable[[int], bool],
) -> Tensor:
    """The final x of the a = 0 chain from x0 with `new`'s velocity at the steps k where
    swap(k), `old`'s elsewhere; caches: (old's, new's) prefilled caches."""
    sigmas = sigma_schedule(K, shift)
    x = x0
    for k in range(K):
        policy, cache = (new, caches[1]) if swap(k) else (old, caches[0])
        v = policy.velocity(cache, x, sigmas[k].expand(x.shape[0]))
        x = ode_step(x, v, sigmas[k], sigmas[k + 1])
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("iteration", type=int)
    ap.add_argument("--steps", type=int, default=512, help="kept steps measured (the first N)")
    ap.add_argument("--from", dest="src", type=Path, help="a policy dir (default: policy n-1)")
    ap.add_argument("--to", type=Path, help="a policy dir whose two halves are measured")
    args = ap.parse_args()
    from wamrl.policy import load_policy

    run, n = args.run_dir, args.iteration
    _, _, data = load_iteration(run, n)
    if (args.src is None) != (args.to is None):
        ap.error("--from and --to go together")
    prev_dir = args.src or paths.policy_dir(run, n - 1)
    if args.to is not None:
        parts = policy_halves(load_policy(args.to, device="cpu"))
    else:
        parts = {
            "actor": load_tensors(paths.actor_dir(run, n) / paths.ACTOR_FILE),
            "world_model": load_tensors(paths.world_model_dir(run, n) / paths.LORA_FILE),
        }

    def policy_with(*names: str) -> Policy:
        policy = load_policy(prev_dir, device="cpu")
        for name in names:
            policy.load_state_dict(parts[name], strict=False)
        return policy.eval()

    @torch.no_grad()
    def actions(policy: Policy) -> np.ndarray:
        out, n = [], min(args.steps, len(data))
        for start in range(0, n, 64):
            idx = np.arange(start, min(start + 64, n))
            x0 = chunk_noise(start, len(idx))
            res = sample_chunk(policy, policy.prefill(data.obs(idx, "cpu")), len(idx), data.K, 0.0,
                               data.shift, None, x0=x0)  # fmt: skip
            out.append(res.chain[:, -1].numpy())
        return np.concatenate(out)

    def measure(*names: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        policy = policy_with(*names)
        out = learner_pass(policy, data, 64, "cpu", limit=args.steps)
        return out.mu, out.std, actions(policy)

    mu0, std, act0 = measure()
    k, task = data.k_star[: len(mu0)], data.task[: len(mu0)]
    result = {"iteration": n, "steps": int(len(mu0)), "from": str(prev_dir),
              "to": str(args.to or f"policy {n}")}  # fmt: skip
    for label, names in (("actor", ("actor",)), ("world_model", ("world_model",)),
                         ("both", ("actor", "world_model"))):  # fmt: skip
        mu, _, act = measure(*names)
        kl = gaussian_kl(torch.from_numpy(mu), torch.from_numpy(mu0),
                         torch.from_numpy(std)[:, None, None]).numpy()  # fmt: skip
        result[label] = {
            "kl": float(kl.mean()),
            "kl_by_k_star": {int(s): float(kl[k == s].mean()) for s in np.unique(k)},
            # a mean over tasks can hide one task's large move (eval scores every task)
            "kl_by_task": {int(t): float(kl[task == t].mean()) for t in np.unique(task)},
            "action_rms_change": float(np.sqrt(((act - act0) ** 2).mean())),
            "action_rms_change_by_task": {
                int(t): float(np.sqrt(((act - act0)[task == t] ** 2).mean()))
                for t in np.unique(task)
            },
            "action_rms_change_by_dim": np.sqrt(((act - act0) ** 2).mean((0, 1))).round(4).tolist(),
            # the gripper (last dim) acts by its sign: chunk entries whose sign flipped
            "gripper_sign_flips": float((np.sign(act[..., -1]) != np.sign(act0[..., -1])).mean()),
        }
    old, new = policy_with(), policy_with("actor", "world_model")
    sq = np.zeros(data.K)
    for start in range(0, len(mu0), 64):
        idx = np.arange(start, min(start + 64, len(mu0)))
        obs = data.obs(idx, "cpu")
        caches = (old.prefill(obs), new.prefill(obs))
        x0, ref = chunk_noise(start, len(idx)), torch.from_numpy(act0[idx])  # the all-old chain
        for step in range(data.K):
            x = ode_chain_swapped(old, new, caches, x0, data.K, data.shift,
                                  lambda k, s=step: k == s)  # fmt: skip
            sq[step] += float(((x - ref) ** 2).mean((1, 2)).sum())
    result["both"]["action_rms_change_by_step"] = np.sqrt(sq / len(mu0)).round(4).tolist()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
