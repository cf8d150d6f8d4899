"""Supervised fine-tuning of a policy on expert demonstrations with Fast-WAM's losses.

One step = action flow matching on a batch of queries (image + proprio at env step 10q,
target the next 32 actions, normalised) + video flow matching on a batch of windows of
`video_frames` frames 4 env steps apart, the first frame clean (Policy.video_loss).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from wamrl.contract import FRAME_STRIDE
from wamrl.demos import QUERY_EVERY, DemoSet, action_chunk, n_frames
from wamrl.envs.conventions import Normalizer, image_to_model_input
from wamrl.policy.base import Obs, Policy


def random_shift(img: Tensor, pad: int, generator: torch.Generator) -> Tensor:
    """Shift each camera view (the two 224 x 224 halves of [B, 3, 224, 448]) by its own
    random whole-pixel offset in [-pad, pad] per axis, edges repeated (DrQ's augmentation).
    out[y, x] = view[clamp(y + dy), clamp(x + dx)]; offsets come from `generator`, drawn where it lives."""
    if pad == 0:
        return img
    b, c, h, w2 = img.shape
    w, n = w2 // 2, 2 * b
    views = img.view(b, c, h, 2, w).transpose(1, 3).reshape(n, h, c, w)  # [n, h, c, w]
    shifts = torch.randint(-pad, pad + 1, (2, n, 1), generator=generator, device=generator.device)
    dy, dx = shifts.to(img.device)
    rows = (torch.arange(h, device=img.device) + dy).clamp(0, h - 1)  # [n, h]
    cols = (torch.arange(w, device=img.device) + dx).clamp(0, w - 1)  # [n, w]
    views = views.gather(1, rows[:, :, None, None].expand(n, h, c, w))
    views = views.gather(3, cols[:, None, None, :].expand(n, h, c, w))
    return views.view(b, 2, h, c, w).transpose(1, 3).reshape(b, c, h, w2)


def _flat_pixels(per_episode: list[np.ndarray], device: torch.device) -> tuple[Tensor, np.ndarray]:
    """Every episode's uint8 images in one tensor on `device` + each episode's first row.
    Copied episode by episode, so the host never holds a second full copy."""
    starts = np.cumsum([0] + [len(x) for x in per_episode])
    flat = torch.empty(
        (int(starts[-1]), *per_episode[0].shape[1:]), dtype=torch.uint8, device=device
    )
    for x, s in zip(per_episode, starts[:-1], strict=True):
        flat[s : s + len(x)] = torch.from_numpy(x)
    return flat, starts[:-1]


@dataclass
class Batches:
    """Samples SFT batches from a DemoSet, normalised for the model. The uint8 pixels live
    on `device` (a few GB for hundreds of demos: nothing for a GPU), so a step gathers its
    images there instead of stacking and copying them on the host."""

    demos: DemoSet
    norm: Normalizer
    context: Tensor  # [40, L, Dc] per task
    context_mask: Tensor  # [40, L]
    device: torch.device
    augment_shift: int = 0  # sft.augment_shift: random shift of action-loss images

    def __post_init__(self) -> None:
        # Every (episode, query) pair; and every video window start (episode, frame).
        self.queries = np.array(
            [(e, q) for e, ims in enumerate(self.demos.images) for q in range(len(ims))]
        )
        self.video_lengths = np.array([len(f) for f in self.demos.frames])
        self.images, self.image_start = _flat_pixels(self.demos.images, self.device)
        self.frames, self.frame_start = _flat_pixels(self.demos.frames, self.device)
        self.context = self.context.to(self.device)
        self.context_mask = self.context_mask.to(self.device)

    def _put(self, x: np.ndarray) -> Tensor:
        """Host array -> device. On CUDA through pinned memory, asynchronously: a copy from
        pageable memory would wait for every queued kernel, once per tensor per step."""
        t = torch.from_numpy(np.ascontiguousarray(x))
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _ctx(self, tasks: np.ndarray) -> tuple[Tensor, Tensor]:
        t = self._put(tasks.astype(np.int64))
        return self.context[t], self.context_mask[t]

    def _pixels(self, flat: Tensor, rows: np.ndarray) -> Tensor:
        return image_to_model_input(flat[self._put(rows.astype(np.int64))])

    def _state(self, e: int, t: int) -> np.ndarray:
        s = self.demos.state[e]
        return s[min(t, len(s) - 1)]

    def actions(
        self, rng: np.random.Generator, batch: int, generator: torch.Generator | None = None
    ) -> tuple[Obs, Tensor]:
        """generator draws the augmentation shifts (needed when augment_shift > 0)."""
        pick = self.queries[rng.integers(len(self.queries), size=batch)]
        image = self._pixels(self.images, self.image_start[pick[:, 0]] + pick[:, 1])
        if self.augment_shift:
            assert generator is not None, "augmentation needs a torch generator"
            image = random_shift(image, self.augment_shift, generator)
        state = np.stack([self._state(e, q * QUERY_EVERY) for e, q in pick])
        chunks = np.stack([action_chunk(self.demos.action[e], q * QUERY_EVERY) for e, q in pick])
        ctx, mask = self._ctx(self.demos.task[pick[:, 0]])
        obs = Obs(
            image=image,
            proprio=self._put(self.norm.normalize_state(state).astype(np.float32)),
            context=ctx,
            context_mask=mask,
        )
        return obs, self._put(self.norm.normalize_action(chunks).astype(np.float32))

    def video(
        self, rng: np.random.Generator, batch: int, frames: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """(video [B, F, 3, 224, 448], context, mask, proprio) or None if no episode is long
        enough for a window of `frames` frames."""
        long_enough = np.flatnonzero(self.video_lengths >= frames)
        if not len(long_enough):
            return None
        eps = rng.choice(long_enough, size=batch)
        starts = np.array([int(rng.integers(self.video_lengths[e] - frames + 1)) for e in eps])
        rows = (self.frame_start[eps] + starts)[:, None] + np.arange(frames)  # [B, F]
        states = [self._state(e, j * FRAME_STRIDE) for e, j in zip(eps, starts, strict=True)]
        ctx, mask = self._ctx(self.demos.task[eps])
        video = self._pixels(self.frames, rows)
        proprio = self._put(self.norm.normalize_state(np.stack(states)).astype(np.float32))
        return video, ctx, mask, proprio


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def steps_within(budget_s: float, elapsed_s: float, done: int, steps: int) -> int:
    """The step count that ends training inside `budget_s`, from `done` steps measured to
    take `elapsed_s`: done + the whole steps the rest of the budget holds at that rate,
    capped at `steps`, at least done + 1. The first steps carry warm-up costs, so the rate
    is pessimistic and the run ends a little early rather than late."""
    rate = elapsed_s / done
    return max(done + 1, min(steps, done + int((budget_s - elapsed_s) / rate)))


def train(
    policy: Policy,
    batches: Batches,
    cfg: dict[str, Any],
    seed: int,
    progress: Any = None,
    on_snapshot: Callable[[int], None] | None = None,
) -> list[dict[str, float]]:
    """cfg = the `sft` section. Trains every parameter of `policy` in place; returns the log.
    With cfg["time_budget_s"] set, `steps` is a cap: the count is cut once the warm-up has
    been timed (cosine progress is still 0 there, so the schedule stays continuous).
    With cfg["save_every"] set, on_snapshot(steps done) is called every that many steps
    before the last (the caller saves the policy: a run cut off still leaves a checkpoint)."""
    rng = np.random.default_rng(seed)
    # Noise and augmentation are drawn on the training device: no host-to-device copy of
    # them per step (each would wait for the GPU queue to drain).
    gen = torch.Generator(device=batches.device).manual_seed(seed)
    params = [p for p in policy.parameters() if p.requires_grad]
    # fused=True: one kernel for the whole update on CUDA instead of a few per tensor.
    opt = torch.optim.AdamW(
        params, lr=cfg["lr"], weight_decay=cfg["weight_decay"], fused=batches.device.type == "cuda"
    )
    policy.train()
    log: list[dict[str, float]] = []
    t0 = time.perf_counter()
    steps, budget = cfg["steps"], cfg.get("time_budget_s")
    timed_at = max(cfg["warmup"], 10)  # steps timed before the count is cut to the budget
    task = progress.add_task("sft", total=steps, info="") if progress is not None else None
    step = 0
    while step < steps:
        if budget is not None and step == timed_at:
            if batches.device.type == "cuda":  # time the work queued so far, not its queueing
                torch.cuda.synchronize(batches.device)
            steps = steps_within(budget, time.perf_counter() - t0, step, steps)
            if progress is not None:
                progress.update(task, total=steps)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, cfg["lr"], cfg["warmup"])
        obs, target = batches.actions(rng, cfg["batch"], gen)
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
        if step % cfg["log_every"] == 0 or step == steps - 1:
            log.append(
                {
                    "step": step,
                    "action_loss": loss_a.item(),
                    "video_loss": loss_v.item(),
                    "grad_norm": float(gnorm),
                    "lr": opt.param_groups[0]["lr"],
                    "elapsed_s": time.perf_counter() - t0,
                }
            )
            if progress is not None:
                progress.update(task, info=f"action loss {log[-1]['action_loss']:.4f}")
        if progress is not None:
            progress.update(task, advance=1)
        step += 1
        every = cfg.get("save_every")
        if on_snapshot is not None and every and step % every == 0 and step < steps:
            policy.eval()
            on_snapshot(step)
            policy.train()
    policy.eval()
    return log


__all__ = ["Batches", "lr_at", "n_frames", "random_shift", "steps_within", "train"]
