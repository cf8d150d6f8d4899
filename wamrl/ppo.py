"""The actor update: PPO clip per denoising step (seed 002, docs/design.md "Actor").

For each kept macro-step the rollout stored x_{k*}, x_{k*+1} and log pi_old of that one
stochastic transition. The learner recomputes the SDE mean mu from x_{k*} with gradients
through the action expert (the first-frame cache is computed under no_grad: the video
expert is frozen here) and optimises

    rho = exp(log N(x_{k*+1}; mu_new, std^2) - log pi_old)
    L   = -mean[min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)]
          + lambda_ref mean[sum (mu_new - mu_ref)^2 / (2 std^2)]

Trust region: the KL of the iteration's policy from pi_old at the stored x_{k*} is known in
closed form, KL = sum (mu_new - mu_old)^2 / (2 std^2) (both Gaussians share std), so the
update measures it exactly on every minibatch and stops once it passes actor.target_kl.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from wamrl import distributed
from wamrl.contract import ACTION_DIM, CHUNK_LEN, IMAGE_HW, PROPRIO_DIM, uint8_to_model
from wamrl.master import MasterWeightOptimizer
from wamrl.policy.base import Obs, Policy
from wamrl.runtime import AMP_DTYPES, autocast
from wamrl.training import NonFiniteError


class LogProbMismatchError(RuntimeError):
    """The learner's log pi on unchanged weights does not reproduce the rollout's log pi_old."""


def ppo_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    clip_low: float,
    clip_high: float,
    kl_ref: Tensor | None = None,
    ref_kl: float = 0.0,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped PPO surrogate (clip-higher when clip_high > clip_low) + optional reference KL.

    weight: per-sample weights of the surrogate (actor.step_weight: sampler.step_weights of
    each sample's k*); the policy loss is -mean(weight * min(rho A, clip(rho) A)).

    kl_ref: the per-sample closed-form KL to the reference policy (sampler.gaussian_kl);
    the loss adds ref_kl * mean(kl_ref). Returns (loss, stats) with stats: policy loss, clip
    fraction (share of samples whose ratio left [1 - clip_low, 1 + clip_high]), approx KL =
    mean((rho - 1) - log rho) (Schulman's k3 estimator, >= 0), mean ratio, and the reference
    KL if given.
    """
    log_ratio = logp_new - logp_old
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    policy_loss = -(surrogate if weight is None else weight * surrogate).mean()
    loss = policy_loss
    stats: dict[str, float] = {}
    if kl_ref is not None:
        # Not seed 002's mean(log pi - log pi_ref) on samples of pi_old: its gradient is that
        # of log pi alone and does not pull toward the reference; the closed form does.
        ref_term = kl_ref.mean()
        loss = loss + ref_kl * ref_term
        stats["ref_kl"] = float(ref_term.detach())
    with torch.no_grad():
        outside = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
        stats.update(
            policy_loss=float(policy_loss.detach()),
            clip_fraction=float(outside.float().mean()),
            approx_kl=float(((ratio - 1.0) - log_ratio).mean()),
            ratio_mean=float(ratio.mean()),
        )
    return loss, stats


@dataclass
class ActorData:
    """The kept macro-steps of one iteration, flattened over shards (N steps).

    Images stay uint8 until a minibatch is drawn (a 224 x 448 frame is 300 kB as uint8,
    1.2 MB as float32). `where` names each step's (shard, episode, step) for errors.
    """

    image: np.ndarray  # uint8 [N, 224, 448, 3]
    proprio: np.ndarray  # float32 [N, 8]
    task: np.ndarray  # int64 [N]
    x_k: np.ndarray  # float32 [N, 32, 7]  chain[:, k*]
    x_next: np.ndarray  # float32 [N, 32, 7]  chain[:, k* + 1]
    k_star: np.ndarray  # int64 [N]
    logp_old: np.ndarray  # float32 [N]
    adv: np.ndarray  # float32 [N]
    where: np.ndarray  # int64 [N, 3] (shard, episode, step)
    context: Tensor  # [40, L, D] per-task text context
    context_mask: Tensor  # [40, L]
    K: int
    noise_a: float
    shift: float
    groups_kept: int = 0
    groups_total: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.logp_old.shape[0])

    def obs(self, idx: np.ndarray, device: torch.device | str) -> Obs:
        image = torch.from_numpy(self.image[idx]).to(device)
        task = torch.from_numpy(self.task[idx]).to(self.context.device)
        return Obs(
            image=uint8_to_model(image),
            proprio=torch.from_numpy(self.proprio[idx]).float().to(device),
            context=self.context[task].to(device),
            context_mask=self.context_mask[task].to(device),
        )

    def tensor(self, name: str, idx: np.ndarray, device: torch.device | str) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(getattr(self, name)[idx])).to(device)


def _transition(
    policy: Policy,
    data: ActorData,
    idx: np.ndarray,
    device: torch.device | str,
    amp: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """(mu, std) of the SDE step at the stored x_{k*}; grads flow through the action expert.

    amp (e.g. torch.bfloat16) autocasts the model's matmuls; the velocity is cast back and
    the SDE mean and std stay float32 (sampler.py casts them).
    """
    from wamrl import sampler

    obs = data.obs(idx, device)
    with autocast(device, amp):
        with torch.no_grad():  # the video expert is frozen in the actor phase (seed 002, 8.3)
            cache = policy.prefill(obs)
        return sampler.recompute_mean_std(
            policy,
            obs,
            data.tensor("x_k", idx, device).float(),
            data.tensor("k_star", idx, device).long(),
            data.K,
            data.noise_a,
            data.shift,
            cache=cache,
        )


def _log_prob(
    policy: Policy,
    data: ActorData,
    idx: np.ndarray,
    device: torch.device | str,
    amp: torch.dtype | None = None,
) -> Tensor:
    """log pi of the stored x_{k*+1} given x_{k*} (float32, [len(idx)])."""
    from wamrl import sampler

    mu, std = _transition(policy, data, idx, device, amp)
    return sampler.gaussian_log_prob(data.tensor("x_next", idx, device).float(), mu, std)


@dataclass
class LearnerPass:
    """The learner's view of every stored step on fixed weights (host arrays)."""

    logp: np.ndarray  # float64 [N]
    mu: np.ndarray  # float32 [N, 32, 7]: the SDE mean at x_{k*}
    std: np.ndarray  # float32 [N]: the SDE std (one per step: it depends on k* alone)


def learner_pass(
    policy: Policy,
    data: ActorData,
    batch: int,
    device: torch.device | str,
    amp: torch.dtype | None = None,
    limit: int | None = None,
) -> LearnerPass:
    """log pi, mu and std of the first `limit` (default all) stored steps on the current
    weights, no grad; a non-finite log pi fails, naming its step.

    In a process group of W > 1 ranks (wamrl.distributed) each rank computes a contiguous
    1/W of the steps and the arrays are summed over the ranks (zeros elsewhere), so every
    rank returns the whole pass."""
    from wamrl import sampler

    n = len(data) if limit is None else min(limit, len(data))
    world = distributed.world_size()
    rows = np.arange(n) if world == 1 else np.array_split(np.arange(n), world)[distributed.rank()]
    logp = np.zeros(n, np.float64)
    mu = np.zeros((n, *data.x_k.shape[1:]), np.float32)
    std = np.zeros(n, np.float32)
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            idx = rows[start : start + batch]
            m, s = _transition(policy, data, idx, device, amp)
            lp = sampler.gaussian_log_prob(data.tensor("x_next", idx, device).float(), m, s)
            logp[idx] = lp.double().cpu().numpy()
            mu[idx] = m.cpu().numpy()
            std[idx] = s.flatten(1)[:, 0].cpu().numpy()
    if world > 1:
        logp, mu, std = distributed.all_reduce_arrays([logp, mu, std], device)
    bad = np.flatnonzero(~np.isfinite(logp))
    if len(bad):
        raise LogProbMismatchError(
            f"recomputed log pi is not finite at (shard, episode, step) = "
            f"{tuple(int(v) for v in data.where[bad[0]])}"
        )
    return LearnerPass(logp, mu, std)


def learner_logp(
    policy: Policy,
    data: ActorData,
    batch: int,
    device: torch.device | str,
    amp: torch.dtype | None = None,
    limit: int | None = None,
) -> np.ndarray:
    """The learner's log pi of the first `limit` (default all) stored steps, float64."""
    return learner_pass(policy, data, batch, device, amp, limit).logp


def kl_by_k_star(
    before: LearnerPass,
    after: LearnerPass,
    k_star: np.ndarray,
    K: int,
    task: np.ndarray | None = None,
) -> dict[str, Any]:
    """The exact KL of the SDE step from `before` to `after` at the stored x_{k*}:
    sum (mu_after - mu_before)^2 / (2 std^2) per step; its mean over all steps, per k* and,
    given each step's task, per task (a mean KL can hide one task's large move)."""
    d = (after.mu - before.mu) / before.std[:, None, None]
    kl = 0.5 * (d.astype(np.float64) ** 2).reshape(len(d), -1).sum(1)
    per_k = {str(k): float(kl[k_star == k].mean()) for k in range(1, K) if (k_star == k).any()}
    out: dict[str, Any] = {"kl": float(kl.mean()) if len(kl) else 0.0, "kl_by_k_star": per_k}
    if task is not None:
        out["kl_by_task"] = {str(t): float(kl[task == t].mean()) for t in np.unique(task)}
    return out


def logp_tolerance(data: ActorData, tol: float) -> np.ndarray:
    """The allowed |ratio - 1| of each step: tol at the least sensitive k*, scaled by
    sampler.logp_sensitivity, since the same float rounding of the velocity (another batch
    shape, another GPU kernel) moves log pi ~24x more at k* = K-1 than at k* = 1."""
    from wamrl import sampler

    sens = sampler.logp_sensitivity(data.K, data.noise_a, data.shift).numpy()
    return tol * sens[data.k_star] / sens[1:].min()


def logp_gap(logp: np.ndarray, data: ActorData, tol: float | None = None) -> dict[str, float]:
    """How far `logp` lies from the rollout's stored log pi_old, step by step; with `tol`,
    also the largest |ratio - 1| as a share of its step's tolerance (logp_tolerance)."""
    delta = logp - data.logp_old[: len(logp)].astype(np.float64)
    dev = np.abs(np.expm1(delta))
    j = int(np.abs(delta).argmax())
    out = {
        "logp_check_steps": float(len(logp)),
        "logp_check_max_abs_delta": float(abs(delta[j])),
        "logp_check_mean_abs_delta": float(np.abs(delta).mean()),
        "logp_check_max_ratio_dev": float(dev.max()),
        "logp_check_worst_step": float(j),
    }
    if tol is not None:
        share = dev / logp_tolerance(data, tol)[: len(logp)]
        out["logp_check_worst_share_of_tol"] = float(share.max())
        out["logp_check_worst_step"] = float(share.argmax())
    return out


def check_logp(
    policy: Policy,
    data: ActorData,
    tol: float,
    batch: int,
    device: torch.device | str,
    limit: int | None = None,
) -> dict[str, float]:
    """Before any update: recomputed log pi must equal log pi_old, |ratio - 1| within
    logp_tolerance (tol at k* = 1, scaled by the step's sensitivity).

    A mismatch (bf16 rollout vs fp32 learner, a different checkpoint, a wrong k* or
    schedule) would silently bias the first PPO ratio; fail loudly and say where.
    """
    return check_pass(learner_pass(policy, data, batch, device, limit=limit), data, tol)


def check_pass(lp: LearnerPass, data: ActorData, tol: float) -> dict[str, float]:
    """check_logp on an already computed learner pass."""
    gap = logp_gap(lp.logp, data, tol)
    if gap["logp_check_worst_share_of_tol"] > 1.0:
        j = int(gap["logp_check_worst_step"])
        s, e, t = (int(v) for v in data.where[j])
        dev = abs(math.expm1(lp.logp[j] - float(data.logp_old[j])))
        raise LogProbMismatchError(
            f"log pi check failed before the actor update: |ratio - 1| = {dev:.3g} > "
            f"{float(logp_tolerance(data, tol)[j]):.3g} (actor.logp_check_tol = {tol:g}, scaled "
            f"for k* = {int(data.k_star[j])}) at shard {s}, episode {e}, step {t} (stored log "
            f"pi_old = {float(data.logp_old[j]):.4f}, recomputed {lp.logp[j]:.4f}). The "
            "learner's log pi on unchanged weights must reproduce the rollout's: check float32 "
            "log-probs, the policy checkpoint the rollout used, K / a / shift, and the chain."
        )
    return gap


def _check_finite_params(params: list[nn.Parameter], where: str) -> None:
    for p in params:
        if not torch.isfinite(p).all():
            raise NonFiniteError(f"non-finite actor parameter after {where}")


def actor_update(
    policy: Policy,
    ref_policy: Policy | None,
    data: ActorData,
    cfg: dict[str, Any],
    optimizer: torch.optim.Optimizer | MasterWeightOptimizer,
    device: torch.device | str = "cpu",
    seed: int = 0,
    kl_scale: float = 1.0,
) -> dict[str, Any]:
    """Up to actor.epochs PPO epochs over all kept macro-steps in shuffled minibatches
    (each computed in actor.micro_batch parts, gradients accumulated: the same update).

    Trust region: before each optimizer step the minibatch's exact KL from pi_old
    (kl_by_k_star's formula on the minibatch) is measured; once it passes actor.target_kl
    the update stops without taking that step (metrics["early_stop"] says where).
    kl_scale multiplies target_kl and max_kl (actor.anneal's trust_region_scale).
    Raises LogProbMismatchError before touching the weights if log pi_old is not
    reproduced, and NonFiniteError on any NaN/Inf in loss, gradients or parameters.
    Returns {"logp_check": ..., "epochs": [per-epoch metrics], "kl": ..., ...}.

    Data parallel (a torch.distributed process group of W > 1 ranks, wamrl.distributed):
    every rank draws the same permutation and takes a contiguous 1/W of each minibatch;
    its parts' losses are weighted by len(part) / len(minibatch), so the all-reduced SUM
    of the gradients is the one-process minibatch mean. Loss and stats (the KL of the
    early stop included) are all-reduced the same way, so grad clipping, the stop and the
    optimizer step are identical on every rank and equal one process's within float
    rounding. The learner passes before and after (log pi_old, the final KL) are split over
    the ranks and summed (learner_pass). Without a process group nothing here changes.
    """
    from wamrl import sampler

    acfg = cfg["actor"]
    params = [p for p in policy.parameter_groups()["actor"] if p.requires_grad]
    rank, world = distributed.rank(), distributed.world_size()
    target_kl = _scaled(acfg.get("target_kl"), kl_scale)
    max_kl = _scaled(acfg.get("max_kl"), kl_scale)
    metrics: dict[str, Any] = {
        # the bounds this update runs under (a skipped one too: what it would have had)
        "trust_region": {"scale": kl_scale, "target_kl": target_kl, "max_kl": max_kl},
        "steps": len(data),
        "groups_kept": data.groups_kept,
        "groups_total": data.groups_total,
        "epochs": [],
        "early_stop": None,
        "kl_trace": [],  # the minibatch's exact KL from pi_old before each optimizer step
    }
    if len(data) == 0:
        metrics["skipped"] = "no kept macro-steps (every group was degenerate or empty)"
        return metrics
    # actor.minibatch null: every optimizer step sees all the iteration's kept steps. An
    # update that stops at target_kl after a few steps is then not a few noisy minibatches.
    mb = len(data) if acfg["minibatch"] is None else int(acfg["minibatch"])
    # actor.micro_batch: a minibatch's forward/backward in parts of this size (gradients
    # accumulate; the same update) so that a minibatch need not fit the GPU at once.
    micro = min(int(acfg.get("micro_batch") or mb), mb)
    amp = AMP_DTYPES[acfg.get("amp")]
    ref_kl = float(acfg["ref_kl"])
    step_weight = None  # [K] per-k* loss weights (actor.step_weight), on the device
    if acfg.get("step_weight", "none") == "inv_sensitivity":
        kmax = cfg.get("sampler", {}).get("kstar_max")
        step_weight = sampler.step_weights(data.K, data.noise_a, data.shift, kmax).to(device)
    # The stats' keys in one-process order (a rank with an empty share computes none).
    stat_keys = ["policy_loss", "clip_fraction", "approx_kl", "ratio_mean", "kl"]
    if ref_policy is not None and ref_kl != 0.0:
        stat_keys.insert(0, "ref_kl")
    if acfg.get("logp_old", "rollout") == "recompute":
        # The ratio's denominator is the learner's own log pi on the unchanged weights, in
        # the update's precision, so it starts at 1 even when the rollout ran in bf16; the
        # rollout's value is only compared (the behaviour/learner gap, reported).
        old = learner_pass(policy, data, micro, device, amp)
        metrics["logp_check"] = logp_gap(old.logp, data, float(acfg["logp_check_tol"]))
        logp_old = old.logp
    else:
        # The check compares with the rollout's float32 log pi_old, so it runs in float32.
        old = learner_pass(policy, data, micro, device)
        metrics["logp_check"] = check_pass(old, data, float(acfg["logp_check_tol"]))
        logp_old = data.logp_old

    def host(a: np.ndarray, part: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a[part])).to(device)

    # actor.max_kl: the weights before any step, to scale the update back toward (float32).
    weights = _weights(optimizer, params)
    initial = [w.detach().clone() for w in weights] if max_kl is not None else []
    rng = np.random.default_rng(seed)
    for epoch in range(int(acfg["epochs"])):
        perm = rng.permutation(len(data))
        rows: list[dict[str, float]] = []
        first_ratio = math.nan
        for start in range(0, len(data), mb):
            idx = np.sort(perm[start : start + mb])  # sorted: contiguous-ish reads from numpy
            optimizer.zero_grad(set_to_none=True)
            # The minibatch mean, as a weighted sum of its parts' means (loss and stats).
            loss_sum, stats = 0.0, dict[str, float]()
            mine = idx if world == 1 else np.array_split(idx, world)[rank]
            parts = np.split(mine, range(micro, len(mine), micro)) if len(mine) else []
            for part in parts:
                weight = len(part) / len(idx)
                mu, std = _transition(policy, data, part, device, amp)
                x_next = data.tensor("x_next", part, device).float()
                logp_new = sampler.gaussian_log_prob(x_next, mu, std)
                sample_weight = None  # per-sample weights from each sample's k*
                if step_weight is not None:
                    sample_weight = step_weight[data.tensor("k_star", part, device)]
                kl_ref = None
                if ref_policy is not None and ref_kl != 0.0:
                    with torch.no_grad():
                        mu_ref, _ = _transition(ref_policy, data, part, device, amp)
                    kl_ref = sampler.gaussian_kl(mu, mu_ref, std)
                loss, part_stats = ppo_loss(
                    logp_new,
                    host(np.asarray(logp_old, np.float32), part),
                    data.tensor("adv", part, device).float(),
                    float(acfg["clip_low"]),
                    float(acfg["clip_high"]),
                    kl_ref=kl_ref,
                    ref_kl=ref_kl,
                    weight=sample_weight,
                )
                if not torch.isfinite(loss):
                    raise NonFiniteError(
                        f"non-finite actor loss {float(loss.detach())} "
                        f"(epoch {epoch}, minibatch at {start})"
                    )
                with torch.no_grad():  # exact KL from pi_old: both Gaussians share std
                    part_stats["kl"] = float(
                        sampler.gaussian_kl(mu, host(old.mu, part), std).mean()
                    )
                (loss * weight).backward()
                loss_sum += weight * float(loss.detach())
                for k, v in part_stats.items():
                    stats[k] = stats.get(k, 0.0) + weight * v
            if world > 1:  # the minibatch's mean over all ranks' parts
                summed = distributed.all_reduce_sum(
                    [loss_sum, *(stats.get(k, 0.0) for k in stat_keys)], device
                )
                loss_sum, stats = summed[0], dict(zip(stat_keys, summed[1:], strict=True))
                distributed.all_reduce_grads(params, device)
            if epoch == 0 and start == 0:
                # Parameters used only inside the no_grad cache (e.g. an encoder that feeds
                # prefill) get no gradient here; report how many so it is not silent.
                metrics["actor_params_without_grad"] = sum(p.grad is None for p in params)
            metrics["kl_trace"].append(stats["kl"])
            if target_kl is not None and stats["kl"] > float(target_kl):
                # The weights already sit target_kl from pi_old here; this step is not taken.
                metrics["early_stop"] = {
                    "epoch": epoch,
                    "minibatch": start // mb,
                    "kl": stats["kl"],
                    "optimizer_steps": epoch * math.ceil(len(data) / mb) + start // mb,
                }
                break
            grad_norm = torch.nn.utils.clip_grad_norm_(params, float(acfg["grad_clip"]))
            if not torch.isfinite(grad_norm):
                raise NonFiniteError(
                    f"non-finite actor gradient norm (epoch {epoch}, minibatch at {start})"
                )
            optimizer.step()
            _check_finite_params(
                params, f"the optimizer step (epoch {epoch}, minibatch at {start})"
            )
            if start == 0:
                first_ratio = stats["ratio_mean"]
            rows.append({"loss": loss_sum, "grad_norm": float(grad_norm), **stats})
        if rows:
            epoch_metrics: dict[str, Any] = {
                k: float(np.mean([r[k] for r in rows])) for k in rows[0]
            }
            epoch_metrics.update(
                epoch=epoch,
                minibatches=len(rows),
                ratio_first_minibatch=first_ratio,
                groups_kept=data.groups_kept,
            )
            metrics["epochs"].append(epoch_metrics)
        if metrics["early_stop"] is not None:
            break
    optimizer.zero_grad(set_to_none=True)
    # The iteration's step, measured exactly over every kept step (one more no-grad pass).
    after = learner_pass(policy, data, micro, device, amp)
    metrics.update(kl_by_k_star(old, after, data.k_star, data.K, data.task))
    if max_kl is not None and metrics["kl"] > max_kl:
        metrics["kl_projection"] = project_update(
            policy, data, old, metrics["kl"], initial, weights, optimizer, max_kl, micro,
            device, amp,
        )  # fmt: skip
        metrics.update(
            kl_by_k_star(old, metrics["kl_projection"].pop("after"), data.k_star, data.K, data.task)
        )
    return metrics


def trust_region_scale(anneal: str, iteration: int, iterations: int) -> float:
    """actor.anneal: the factor on target_kl and max_kl at iteration n (1-based) of a run of
    N = pipeline.iterations. "linear": the update's length falls linearly, 1 - (n - 1) / N
    (CleanRL's anneal_lr), held at its last value 1 / N past N; a small update's KL grows
    as the square of its length, so the bounds take the square. "none": 1.

    Why: at a constant KL per update the policy walked on past its peak (data/rl_ketchup_cpu
    recipe/: 0.450 at policy 5, 0.075 at 8), each update the same length whether or not the
    gradient still pointed uphill; constant-step SGD settles only when its step shrinks.
    """
    if anneal == "none":
        return 1.0
    if anneal != "linear":
        raise ValueError(f"actor.anneal: unknown schedule {anneal!r} (none | linear)")
    if iteration < 1 or iterations < 1:
        raise ValueError(f"trust_region_scale: iteration {iteration} of {iterations}")
    n = min(iteration, iterations)
    return (1.0 - (n - 1) / iterations) ** 2


def _scaled(bound: float | None, scale: float) -> float | None:
    return None if bound is None else float(bound) * scale


def _weights(optimizer: Any, params: list[nn.Parameter]) -> list[Tensor]:
    """The float32 tensors the optimizer steps: a MasterWeightOptimizer's masters (the
    float32 parameters themselves among them), else the parameters."""
    return optimizer.masters if isinstance(optimizer, MasterWeightOptimizer) else params


def search_alpha(
    kl_at: Callable[[float], float], kl: float, max_kl: float, tries: int = 8
) -> tuple[float, int]:
    """The alpha in (0, 1) at which the scaled-back update's KL, kl_at(alpha), lies within
    0.9-1 x max_kl, given KL(1) = kl > max_kl. Each try aims at 0.95 x max_kl along the
    local power law KL ~ alpha^p, p fitted through the last two points tried (2, the
    Gaussian KL's small-step law, before there are two), inside the bracket [lo, hi] of
    alphas known to lie under and over max_kl (else its midpoint). Returns (lo, tries made):
    the highest alpha found under max_kl, 0 if none was.

    Why fit p: aimed at max_kl by the square law alone, every try of a KL that grows slower
    than alpha^2 lands just over it, so the bracket's low end stayed at 0 and the whole
    update was discarded (the H100 run of 2026-12-07, iteration 1: KL 0.021, 7 passes).
    """
    target = 0.95 * max_kl
    lo, hi, p = 0.0, 1.0, 2.0
    alpha, kl_a = 1.0, kl
    for passes in range(1, tries + 1):
        guess = alpha * (target / kl_a) ** (1.0 / p) if kl_a > 0 else hi
        prev, kl_prev = alpha, kl_a
        alpha = guess if lo < guess < hi else 0.5 * (lo + hi)
        kl_a = kl_at(alpha)
        if kl_a > 0 and kl_prev > 0 and kl_a != kl_prev:
            p = min(max(math.log(kl_a / kl_prev) / math.log(alpha / prev), 0.5), 4.0)
        if kl_a <= max_kl:
            lo = alpha
            if kl_a >= 0.9 * max_kl:
                return lo, passes
        else:
            hi = alpha
    return lo, tries


@torch.no_grad()
def project_update(
    policy: Policy,
    data: ActorData,
    old: LearnerPass,
    kl: float,
    start: list[Tensor],
    weights: list[Tensor],
    optimizer: Any,
    max_kl: float,
    batch: int,
    device: torch.device | str,
    amp: torch.dtype | None = None,
) -> dict[str, Any]:
    """Scale the update (whose exact KL from pi_old is `kl` > max_kl) back along its own
    direction, w = start + alpha (end - start), to the alpha search_alpha finds (KL within
    0.9-1 x max_kl), each try one exact learner pass.

    Why: target_kl is checked before each optimizer step, so the step that crosses it is
    taken whole; one Adam step at lr 1e-5 reached 2.4x target_kl on the GPU and 5x with
    beta1 0 (data/rl_object_v6, data/rl_ketchup_cpu). Adam's state is left as it is.
    Returns {"kl_before", "alpha", "passes", "after" (the LearnerPass at alpha)}.
    """
    end = [w.detach().clone() for w in weights]
    measured: dict[float, LearnerPass] = {0.0: old}  # alpha 0: the weights before the update

    def place(alpha: float) -> None:
        for w, s, e in zip(weights, start, end, strict=True):
            w.copy_(s + alpha * (e - s))
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.sync_params()

    def kl_at(alpha: float) -> float:
        place(alpha)
        measured[alpha] = learner_pass(policy, data, batch, device, amp)
        return kl_by_k_star(old, measured[alpha], data.k_star, data.K)["kl"]

    alpha, tries = search_alpha(kl_at, kl, max_kl)
    place(alpha)
    return {"kl_before": kl, "alpha": alpha, "passes": tries, "after": measured[alpha]}


# ---- reading the kept macro-steps from the stores -----------------------------------------


def load_actor_data(
    shard_paths: list[Any],
    context: Tensor,
    context_mask: Tensor,
    cfg: dict[str, Any],
    groups_kept: int = 0,
    groups_total: int = 0,
) -> ActorData:
    """Flatten the kept macro-steps of every shard (reward/ must have been written).

    Kept = step/valid & reward/group_kept & A defined; "A defined" is A != 0, since the
    reward stage writes A = 0 where fewer than two group members were alive (such steps
    carry no gradient and would only dilute the minibatch mean). K and a come from the
    store attrs (what the rollout actually used); cfg["sampler"] only without shards.
    """
    from wamrl import store

    cols: dict[str, list[np.ndarray]] = {
        k: []
        for k in ("image", "proprio", "task", "x_k", "x_next", "k_star", "logp_old", "adv", "where")
    }
    K = a = None
    for w, path in enumerate(shard_paths):
        g = store.open_store(path)  # validates the rollout part and reward/
        K_s, a_s = g.attrs["K"], g.attrs["a"]
        if K is not None and (K_s != K or a_s != a):
            raise ValueError(
                f"shards disagree on the sampler: K {K} vs {K_s}, a {a} vs {a_s} ({path})"
            )
        K, a = K_s, a_s
        if not store.has_reward(g):
            raise FileNotFoundError(f"{path} has no reward/ group: run the reward stage first")
        steps = store.read_step_table(g, ["valid", "advantage", "k_star", "logp_old"])
        ep = store.read_episode_table(g)
        adv = steps["advantage"]
        sel = steps["valid"] & ep["group_kept"][:, None] & np.isfinite(adv) & (adv != 0.0)
        task = ep["task"].astype(np.int64)
        k_star_all = steps["k_star"].astype(np.int64)
        logp_all = steps["logp_old"]
        for e in np.flatnonzero(sel.any(axis=1)):
            ts = np.flatnonzero(sel[e])
            upto = slice(0, int(ts[-1]) + 1)  # kept steps are valid: within the stored prefix
            chain = store.read_episode_steps(g, "chain", e, upto)[ts]  # [n, K+1, 32, 7]
            ks = k_star_all[e, ts]
            rows = np.arange(ts.size)
            cols["x_k"].append(chain[rows, ks])
            cols["x_next"].append(chain[rows, ks + 1])
            cols["image"].append(store.read_episode_steps(g, "image", e, upto)[ts])
            cols["proprio"].append(store.read_episode_steps(g, "proprio", e, upto)[ts])
            cols["task"].append(np.full(ts.size, task[e], dtype=np.int64))
            cols["k_star"].append(ks)
            cols["logp_old"].append(logp_all[e, ts])
            cols["adv"].append(adv[e, ts])
            cols["where"].append(np.stack([np.full(ts.size, w), np.full(ts.size, e), ts], axis=1))
    empty = {
        "image": (0, *IMAGE_HW, 3),
        "proprio": (0, PROPRIO_DIM),
        "x_k": (0, CHUNK_LEN, ACTION_DIM),
        "x_next": (0, CHUNK_LEN, ACTION_DIM),
        "where": (0, 3),
    }
    out = {}
    for k, v in cols.items():
        out[k] = (
            np.concatenate(v)
            if v
            else np.zeros(empty.get(k, (0,)), dtype=np.uint8 if k == "image" else np.float32)
        )
    for k in ("task", "k_star", "where"):
        out[k] = out[k].astype(np.int64)
    return ActorData(
        **out,
        context=context,
        context_mask=context_mask,
        K=int(K if K is not None else cfg["sampler"]["K"]),
        noise_a=float(a if a is not None else cfg["sampler"]["noise_a"]),
        shift=float(cfg["sampler"]["shift"]),
        groups_kept=groups_kept,
        groups_total=groups_total,
    )


def load_iteration(run_dir: Path, iteration: int) -> tuple[dict[str, Any], list[Path], ActorData]:
    """What iteration n's actor trained on, for offline analysis (scripts/update_split.py,
    scripts/grad_snr.py): (the config its rewards were made under, its shard paths, its kept
    steps with policy n-1's task contexts)."""
    from wamrl import paths
    from wamrl.artifact import read_json
    from wamrl.config import RolloutSection, section
    from wamrl.policy.text import load_contexts

    cfg = read_json(paths.reward_done(run_dir, iteration))["config"]
    context, mask = load_contexts(paths.policy_dir(run_dir, iteration - 1) / paths.CONTEXT_FILE)
    shards = paths.shard_paths(run_dir, iteration, section(cfg, RolloutSection).workers)
    return cfg, shards, load_actor_data(shards, context, mask, cfg)
