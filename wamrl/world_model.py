"""World-model update: video flow matching + feature KL through LoRA (docs/design.md "World model").

Windows are 33 raw frames t0 .. t0+32 of a successful video-SFT episode, sampled every
4th frame (9 frames, the first is the clean condition), up to 8 per episode at evenly
spaced start offsets. One epoch in batches of 16 minimises

    L = L_video + lambda_KL * L_KL

through the video expert's LoRA parameters only. The feature KL keeps the world model
near the frozen iteration-0 model:

    z     = policy.features(window).mean(over tokens)            [B, D]
    z_ref = frozen.features(window).mean(over tokens)            [B, D]
    L_KL  = mean_{b, d} KL(N(z, S_theta) || N(z_ref, S_ref))   (diagonal Gaussians)
          = mean 0.5 * (log S_ref - log S_theta + (S_theta + (z - z_ref)^2) / S_ref - 1)

Choices (documented because the chapter that defines them is missing):
- z is the token mean of the features, so one Gaussian per feature dimension.
- S_ref is the per-dimension population variance of z_ref over all windows of the first
  run that had any; it is saved and carried to later iterations unchanged.
- S_theta is an EMA (momentum m = 0.99) of the current batch's per-dimension variance.
  The buffer starts at S_ref and is updated from the detached batch variance after each
  step. In the loss, S_theta's *value* is the buffer before this batch, and its
  *gradient* is that of the EMA update, (1 - m) * d var_batch (a straight-through form:
  S = buf + (1 - m) * (var_b - var_b.detach())). Hence L_KL is exactly 0 at init
  (current == frozen, so z == z_ref, and S_theta == S_ref), and gradients flow through
  z and through the current batch's variance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from wamrl import store
from wamrl.contract import FRAME_STRIDE, uint8_to_model
from wamrl.envs.conventions import Normalizer
from wamrl.policy.base import Policy
from wamrl.training import NonFiniteError, trainable_optimizer

VAR_FLOOR = 1e-6  # variances below this are clamped: a dead feature must not divide by 0


@dataclass(frozen=True)
class WindowSpec:
    shard: int
    episode: int
    t0: int  # first raw frame of the window


def window_starts(length: int, window_frames: int = 33, max_windows: int = 8) -> list[int]:
    """Evenly spaced start offsets of up to `max_windows` full windows in `length` frames."""
    last = length - window_frames
    if last < 0:
        return []
    n = min(max_windows, last + 1)
    return sorted({int(round(x)) for x in np.linspace(0, last, n)})


def frames_to_model(frames: np.ndarray) -> Tensor:
    """uint8 [..., H, W, 3] -> float32 [..., 3, H, W] in [-1, 1] (x * 2 / 255 - 1)."""
    return uint8_to_model(torch.from_numpy(np.ascontiguousarray(frames)))


def diag_gauss_kl(z: Tensor, var: Tensor, z_ref: Tensor, var_ref: Tensor) -> Tensor:
    """mean over batch and dims of KL(N(z, var) || N(z_ref, var_ref)), diagonal Gaussians."""
    var = var.clamp_min(VAR_FLOOR)
    var_ref = var_ref.clamp_min(VAR_FLOOR)
    kl = 0.5 * (torch.log(var_ref) - torch.log(var) + (var + (z - z_ref) ** 2) / var_ref - 1.0)
    return kl.mean()


def pooled_features(policy: Policy, batch: dict[str, Tensor]) -> Tensor:
    """Token-mean of the video expert's features: [B, N, D] -> [B, D]."""
    f = policy.features(batch["video"], batch["context"], batch["context_mask"], batch["proprio"])
    return f.mean(dim=1)


class FeatureKL:
    """The S_theta EMA buffer and the frozen S_ref (see the module docstring)."""

    def __init__(
        self, sigma_ref: Tensor, sigma_theta: Tensor | None = None, momentum: float = 0.99
    ):
        self.sigma_ref = sigma_ref.detach().float().clamp_min(VAR_FLOOR)
        init = self.sigma_ref if sigma_theta is None else sigma_theta.detach().float()
        self.sigma_theta = init.clone()
        self.momentum = float(momentum)

    def loss(self, z: Tensor, z_ref: Tensor) -> Tensor:
        m = self.momentum
        var_b = (
            z.float().var(dim=0, unbiased=False)
            if z.shape[0] > 1
            else torch.zeros_like(self.sigma_theta)
        )
        buf = self.sigma_theta.to(z.device)
        sigma = buf + (1.0 - m) * (var_b - var_b.detach())  # value = buffer, grad = EMA update's
        kl = diag_gauss_kl(
            z.float(), sigma, z_ref.float().to(z.device), self.sigma_ref.to(z.device)
        )
        if z.shape[0] > 1:
            self.sigma_theta = (m * buf + (1.0 - m) * var_b.detach()).cpu()
        return kl


def estimate_sigma_ref(z_ref: Tensor) -> Tensor:
    """Per-dimension population variance of the frozen model's pooled features [N, D]."""
    if z_ref.shape[0] < 2:
        raise ValueError("estimating Sigma_ref needs at least two windows")
    return z_ref.float().var(dim=0, unbiased=False).clamp_min(VAR_FLOOR)


def world_model_update(
    policy: Policy,
    frozen: Policy,
    batches: Sequence[dict[str, Tensor]],
    cfg: dict[str, Any],
    sigma_ref: Tensor | None,
    sigma_theta: Tensor | None,
    seed: int = 0,
) -> tuple[dict[str, Any], Tensor | None, Tensor | None]:
    """One epoch (cfg world_model.epochs) over the window batches through LoRA only.

    batches: a sequence (a list, or a lazy reader such as WindowBatches) of dicts with
    video [B, 9, 3, H, W] in [-1, 1], context, context_mask, proprio (at t0), on the
    policy's device. It is read twice: once for the frozen features, once to train. Returns (metrics, sigma_ref, sigma_theta);
    sigma_ref is estimated here from the frozen model if it was None.
    """
    wcfg = cfg["world_model"]
    metrics: dict[str, Any] = {"windows": 0, "batches": len(batches)}
    if len(batches) == 0:
        metrics["skipped"] = "no successful video-SFT episode with a full window: LoRA unchanged"
        return metrics, sigma_ref, sigma_theta
    if int(wcfg["epochs"]) == 0:  # the "no world-model update" ablation
        metrics["skipped"] = "world_model.epochs is 0: LoRA unchanged"
        return metrics, sigma_ref, sigma_theta

    with torch.no_grad():  # the frozen iteration-0 model's features, once per window
        frozen.eval()
        z_refs = []
        for i in range(len(batches)):
            b = batches[i]
            metrics["windows"] += int(b["video"].shape[0])
            z_refs.append(pooled_features(frozen, b).float())
    if sigma_ref is None:
        sigma_ref = estimate_sigma_ref(torch.cat(z_refs).cpu())
        metrics["sigma_ref"] = "estimated from the frozen model on this run's windows"
    else:
        metrics["sigma_ref"] = "carried from an earlier iteration"
    kl = FeatureKL(sigma_ref, sigma_theta, float(wcfg["ema"]))

    # Only LoRA trains. It is bf16 on `fastwam`: float32 masters keep its 5e-5 steps.
    lora, opt = trainable_optimizer(policy, "world_model", float(wcfg["lr"]))
    policy.train()
    lam = float(wcfg["kl_weight"])
    rows: list[dict[str, float]] = []
    step = 0
    for epoch in range(int(wcfg["epochs"])):
        order = np.random.default_rng(seed + epoch).permutation(len(batches))
        for bi in order:
            b = batches[int(bi)]
            gen = torch.Generator(device=b["video"].device).manual_seed(seed * 100_003 + step)
            l_video = policy.video_loss(
                b["video"], b["context"], b["context_mask"], b["proprio"], generator=gen
            )
            z = pooled_features(policy, b)
            l_kl = kl.loss(z, z_refs[int(bi)])
            loss = l_video + lam * l_kl
            if not torch.isfinite(loss):
                raise NonFiniteError(
                    f"non-finite world-model loss (video {float(l_video)}, kl {float(l_kl)})"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in lora if p.grad is not None))
            if not math.isfinite(gn):
                raise NonFiniteError("non-finite world-model LoRA gradient")
            opt.step()
            if not all(torch.isfinite(p).all() for p in lora):
                raise NonFiniteError("non-finite LoRA parameter after the optimizer step")
            rows.append(
                {
                    "loss": float(loss.detach()),
                    "video_loss": float(l_video.detach()),
                    "kl": float(l_kl.detach()),
                    "grad_norm": gn,
                }
            )
            step += 1
    policy.eval()
    metrics.update({k: float(np.mean([r[k] for r in rows])) for k in rows[0]})
    metrics["kl_first_batch"] = rows[0]["kl"]
    metrics["video_loss_first_batch"] = rows[0]["video_loss"]
    metrics["per_batch"] = rows
    return metrics, sigma_ref, kl.sigma_theta


# ---- windows from the stores --------------------------------------------------------------


def list_windows(
    shard_paths: list[Any], wcfg: dict[str, Any]
) -> tuple[list[WindowSpec], dict[str, int]]:
    """Windows of every successful video-SFT episode, in (shard, episode, t0) order."""
    specs: list[WindowSpec] = []
    counts = {"video_sft_episodes": 0, "successful_video_episodes": 0, "too_short": 0}
    for w, path in enumerate(shard_paths):
        # The reward stage may be writing reward/ right now (it and this stage both only
        # need the rollout): check only the rollout's part.
        g = store.open_rollout(path)
        ep = store.read_episode_arrays(g, ["video_sft", "success"])
        sft = ep["video_sft"]
        ok = sft & ep["success"]
        counts["video_sft_episodes"] += int(sft.sum())
        counts["successful_video_episodes"] += int(ok.sum())
        if not ok.any():
            continue
        lengths = store.read_video_length(g).astype(np.int64)
        for e in np.flatnonzero(ok):
            starts = window_starts(
                int(lengths[e]), int(wcfg["window_frames"]), int(wcfg["windows_per_episode"])
            )
            counts["too_short"] += int(not starts)
            specs.extend(WindowSpec(w, int(e), t0) for t0 in starts)
    return specs, counts


class WindowBatches(Sequence):
    """Lazy batches of windows read from the stores (a window is 9 frames, 10.8 MB as float).

    proprio at t0, normalised as the policy sees it everywhere else (SFT, rollout,
    imagination): `video/proprio` [E, F, 8] holds raw proprio, so it goes through
    `normalizer.normalize_state`; without it, the `step/proprio` of the macro-step that
    contains raw frame t0 (t0 // replan_steps, video frame 0 being the first query's
    frame), which the rollout stored already normalised and is used as is.

    normalizer: the stats the rollout normalised with (iter_{n-1}/policy/stats.json). None
    loads each shard's from its `policy_checkpoint` attribute (the rollout's policy dir).
    """

    def __init__(
        self,
        shard_paths: list[Any],
        specs: list[WindowSpec],
        batch: int,
        context: Tensor,
        context_mask: Tensor,
        wcfg: dict[str, Any],
        replan_steps: int,
        device: torch.device | str = "cpu",
        normalizer: Normalizer | None = None,
    ):
        import zarr

        # list_windows validated the stores already.
        self.groups = [zarr.open_group(str(p), mode="r") for p in shard_paths]
        self.episodes = [store.read_episode_arrays(g, ["task", "length"]) for g in self.groups]
        self.normalizer = normalizer
        self._shard_norms: dict[int, Normalizer] = {}
        self.specs = specs
        self.batch = int(batch)
        self.context, self.context_mask = context, context_mask
        self.window_frames = int(wcfg["window_frames"])
        self.replan = int(replan_steps)
        self.device = device

    def __len__(self) -> int:
        return (len(self.specs) + self.batch - 1) // self.batch

    def __getitem__(self, i: int) -> dict[str, Tensor]:  # type: ignore[override]
        if not 0 <= i < len(self):
            raise IndexError(i)
        specs = self.specs[i * self.batch : (i + 1) * self.batch]
        video, proprio, task = [], [], []
        for s in specs:
            g, ep = self.groups[s.shard], self.episodes[s.shard]
            raw = store.read_video(g, s.episode, slice(s.t0, s.t0 + self.window_frames))
            video.append(raw[::FRAME_STRIDE])
            raw_p = store.read_video_proprio(g, s.episode, s.t0)
            if raw_p is not None:  # raw: normalise as the rollout did for its queries
                proprio.append(self._normalizer(s.shard).normalize_state(raw_p))
            else:
                T = int(ep["length"][s.episode])
                t = min(s.t0 // self.replan, max(T - 1, 0))
                proprio.append(store.read_episode_steps(g, "proprio", s.episode, t))
            task.append(int(ep["task"][s.episode]))
        idx = torch.tensor(task)
        return {
            "video": frames_to_model(np.stack(video)).to(self.device),
            "proprio": torch.from_numpy(np.stack(proprio)).to(self.device),
            "context": self.context[idx].to(self.device),
            "context_mask": self.context_mask[idx].to(self.device),
        }

    def _normalizer(self, shard: int) -> Normalizer:
        if self.normalizer is not None:
            return self.normalizer
        if shard not in self._shard_norms:  # only a shard with video/proprio needs stats
            self._shard_norms[shard] = _rollout_normalizer(self.groups[shard])
        return self._shard_norms[shard]


def _rollout_normalizer(g: Any) -> Normalizer:
    """The normaliser of the policy that wrote the shard (its `policy_checkpoint` attr)."""
    pdir = g.attrs.get("policy_checkpoint")
    stats = Path(str(pdir)) / "stats.json" if pdir else None
    if stats is None or not stats.is_file():
        raise FileNotFoundError(
            f"no normalisation stats for the store's video/proprio: pass a normalizer "
            f"(the policy's stats.json); the store's policy_checkpoint is {pdir!r}"
        )
    return Normalizer.load(stats)
