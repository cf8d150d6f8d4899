"""Supervised fine-tuning of a policy on expert demonstrations with Fast-WAM's losses.

One step = action flow matching on a batch of queries (image + proprio at env step 10q,
target the next 32 actions, normalised) + video flow matching on a batch of windows of
`video_frames` frames 4 env steps apart, the first frame clean (Policy.video_loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from wamrl.demos import QUERY_EVERY, VIDEO_STRIDE, DemoSet, action_chunk, n_frames
from wamrl.envs.conventions import Normalizer, image_to_model_input
from wamrl.policy.base import Obs, Policy


@dataclass
class Batches:
    """Samples SFT batches from a DemoSet (uint8 in memory), normalised for the model."""

    demos: DemoSet
    norm: Normalizer
    context: Tensor  # [40, L, Dc] per task
    context_mask: Tensor  # [40, L]
    device: torch.device

    def __post_init__(self) -> None:
        # Every (episode, query) pair; and every video window start (episode, frame).
        self.queries = np.array(
            [(e, q) for e, ims in enumerate(self.demos.images) for q in range(len(ims))]
        )
        self.video_lengths = np.array([len(f) for f in self.demos.frames])

    def _ctx(self, tasks: np.ndarray) -> tuple[Tensor, Tensor]:
        t = torch.as_tensor(tasks, dtype=torch.long)
        return self.context[t].to(self.device), self.context_mask[t].to(self.device)

    def _pixels(self, img: np.ndarray) -> Tensor:
        # uint8 to the device first: a quarter of the bytes, and the float maths runs there.
        # Pinned + non_blocking on CUDA: the host goes on to the next batch meanwhile.
        t = torch.from_numpy(img)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return image_to_model_input(t.to(self.device, non_blocking=True))

    def _state(self, e: int, t: int) -> np.ndarray:
        s = self.demos.state[e]
        return s[min(t, len(s) - 1)]

    def actions(self, rng: np.random.Generator, batch: int) -> tuple[Obs, Tensor]:
        pick = self.queries[rng.integers(len(self.queries), size=batch)]
        img = np.stack([self.demos.images[e][q] for e, q in pick])
        state = np.stack([self._state(e, q * QUERY_EVERY) for e, q in pick])
        chunks = np.stack([action_chunk(self.demos.action[e], q * QUERY_EVERY) for e, q in pick])
        ctx, mask = self._ctx(self.demos.task[pick[:, 0]])
        obs = Obs(
            image=self._pixels(img),
            proprio=torch.as_tensor(self.norm.normalize_state(state), device=self.device),
            context=ctx,
            context_mask=mask,
        )
        return obs, torch.as_tensor(self.norm.normalize_action(chunks), device=self.device)

    def video(
        self, rng: np.random.Generator, batch: int, frames: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """(video [B, F, 3, 224, 448], context, mask, proprio) or None if no episode is long
        enough for a window of `frames` frames."""
        long_enough = np.flatnonzero(self.video_lengths >= frames)
        if not len(long_enough):
            return None
        eps = rng.choice(long_enough, size=batch)
        clips, states = [], []
        for e in eps:
            j = int(rng.integers(len(self.demos.frames[e]) - frames + 1))
            clips.append(self.demos.frames[e][j : j + frames])
            states.append(self._state(e, j * VIDEO_STRIDE))
        ctx, mask = self._ctx(self.demos.task[eps])
        video = self._pixels(np.stack(clips))
        proprio = torch.as_tensor(self.norm.normalize_state(np.stack(states)), device=self.device)
        return video, ctx, mask, proprio


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(
    policy: Policy, batches: Batches, cfg: dict[str, Any], seed: int, progress: Any = None
) -> list[dict[str, float]]:
    """cfg = the `sft` section. Trains every parameter of `policy` in place; returns the log."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    policy.train()
    log: list[dict[str, float]] = []
    task = progress.add_task("sft", total=cfg["steps"], info="") if progress is not None else None
    for step in range(cfg["steps"]):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg["steps"], cfg["lr"], cfg["warmup"])
        obs, target = batches.actions(rng, cfg["batch"])
        loss_a = policy.action_loss(obs, target, generator=gen)
        loss = loss_a
        loss_v = torch.zeros(())
        if cfg["video_weight"] > 0:
            vb = batches.video(rng, cfg["video_batch"], cfg["video_frames"])
            if vb is not None:
                loss_v = policy.video_loss(*vb, generator=gen)
                loss = loss + cfg["video_weight"] * loss_v
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
        opt.step()
        # Read losses back (a GPU sync) only at log steps, so that the next batch is
        # assembled on the CPU while the GPU still works on this one.
        if step % cfg["log_every"] == 0 or step == cfg["steps"] - 1:
            log.append(
                {
                    "step": step,
                    "action_loss": loss_a.item(),
                    "video_loss": loss_v.item(),
                    "grad_norm": float(gnorm),
                    "lr": opt.param_groups[0]["lr"],
                }
            )
            if progress is not None:
                progress.update(task, info=f"action loss {log[-1]['action_loss']:.4f}")
        if progress is not None:
            progress.update(task, advance=1)
    policy.eval()
    return log


__all__ = ["Batches", "lr_at", "n_frames", "train"]
