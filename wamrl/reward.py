"""The reward stage's library (docs/design.md "Reward" and "Advantages").

For every valid macro-step the world model imagines the frames at +4 and +8 env steps
from the stored query image; r^rec = -MSE(imagined, rendered) in the model's [-1, 1]
scale. Then, over the whole iteration (all shards together): normalise r^rec, combine
r = r^task + beta * (1 - gamma) * clip(r~^rec, -c, c) (advantages.combine: task success
stays dominant, checked before any work by check_success_dominates), discount within each
episode, group-normalise into advantages and mark degenerate groups. Every shard gets a
`reward/` group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from rich.progress import Progress
from torch import Tensor

from wamrl import advantages as A
from wamrl import store
from wamrl.contract import N_FUTURE, uint8_to_model
from wamrl.policy.base import Obs, Policy
from wamrl.progress import progress_bar


def step_seed(base: int, shard: int, episode: int, step: int) -> int:
    """A stable 63-bit seed per (shard, episode, step): the first step of an imagine batch."""
    h = hashlib.sha256(f"wamrl-reward/{base}/{shard}/{episode}/{step}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def images_to_model(x: np.ndarray | Tensor) -> Tensor:
    """uint8 [..., H, W, 3] -> float32 [..., 3, H, W] in [-1, 1] (x * 2 / 255 - 1).

    A tensor is converted where it lies: move uint8 to the GPU first (a quarter of the
    bytes, no CPU float pass)."""
    t = x if isinstance(x, Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    return uint8_to_model(t)


def imagine_batches(valid: np.ndarray, batch: int) -> list[np.ndarray]:
    """The shard's valid (episode, step) pairs, episode-major, cut into batches of `batch`:
    [n, 2] int arrays. A function of the valid mask alone, so a rerun batches identically."""
    pairs = np.argwhere(valid)  # row-major: episode-major, steps ascending
    return [pairs[i : i + batch] for i in range(0, len(pairs), batch)]


def _read_batch(g: zarr.Group, pairs: np.ndarray) -> tuple[np.ndarray, ...]:
    """image [B, H, W, 3] u8, proprio [B, 8] f32, frames [B, 2, H, W, 3] u8 for (e, t) pairs,
    one contiguous read per episode in the batch."""
    image, proprio, frames = [], [], []
    for e in np.unique(pairs[:, 0]):
        ts = pairs[pairs[:, 0] == e, 1]
        steps = slice(int(ts[0]), int(ts[-1]) + 1)  # valid steps are a prefix: contiguous
        image.append(store.read_episode_steps(g, "image", e, steps))
        proprio.append(store.read_episode_steps(g, "proprio", e, steps))
        frames.append(store.read_episode_steps(g, "frames", e, steps))
    return np.concatenate(image), np.concatenate(proprio), np.concatenate(frames)


@torch.no_grad()
def reconstruction_rewards(
    policy: Policy,
    g: zarr.Group,
    shard: int,
    context: Tensor,
    context_mask: Tensor,
    imagine_steps: int,
    seed: int,
    device: torch.device | str = "cpu",
    batch: int = 64,
    progress: Progress | None = None,
) -> np.ndarray:
    """r^rec [E, T] for one shard: -mean((imagined - rendered)^2) over both future frames.

    Imagination runs over the shard's valid steps in batches of `batch` (across episodes:
    imagine_batches), each with its own generator seeded from (seed, shard, its first
    episode and step), so a rerun on the same store with the same batch (or a run that skips
    other shards) reproduces the arrays exactly. The next batch is read and decompressed
    while the device imagines this one. 0 on padding. g: store.open_rollout(path).
    progress: a bar that gets one task per shard, advanced per batch (on a CPU the
    imagination takes minutes).
    """
    from concurrent.futures import ThreadPoolExecutor

    valid = store.read_step_table(g, ["valid"])["valid"]
    task = torch.as_tensor(store.read_episode_arrays(g, ["task"])["task"].astype(np.int64))
    r_rec = np.zeros(valid.shape, dtype=np.float32)
    batches = imagine_batches(valid, batch)
    if progress is not None:
        bar = progress.add_task(
            f"reward imagination, shard {shard}",
            total=len(batches),
            info=f"{int(valid.sum())} steps",
        )
    policy.eval()
    with ThreadPoolExecutor(1) as reader:
        pending = reader.submit(_read_batch, g, batches[0]) if batches else None
        for i, pairs in enumerate(batches):
            img, prop, fr = pending.result()  # type: ignore[union-attr]
            if i + 1 < len(batches):
                pending = reader.submit(_read_batch, g, batches[i + 1])
            t = task[pairs[:, 0]]
            obs = Obs(
                image=images_to_model(torch.from_numpy(img).to(device)),
                proprio=torch.from_numpy(prop).to(device),
                context=context[t].to(device),
                context_mask=context_mask[t].to(device),
            )
            e0, t0 = (int(v) for v in pairs[0])
            gen = torch.Generator(device=device).manual_seed(step_seed(seed, shard, e0, t0))
            imagined = policy.imagine(obs, N_FUTURE, steps=imagine_steps, generator=gen).float()
            target = images_to_model(torch.from_numpy(fr).to(device))  # [B, 2, 3, H, W]
            if imagined.shape != target.shape:
                raise ValueError(
                    f"imagined frames {tuple(imagined.shape)} do not match the stored "
                    f"step/frames {tuple(target.shape)} (shard {shard}, episode {e0})"
                )
            mse = ((imagined - target) ** 2).flatten(1).mean(dim=1)
            r_rec[pairs[:, 0], pairs[:, 1]] = (-mse).cpu().numpy()
            if progress is not None:
                progress.update(bar, advance=1)
    return r_rec


@dataclass
class ShardRewardInputs:
    """What the advantage computation needs from one shard."""

    valid: np.ndarray  # bool [E, T]
    r_task: np.ndarray  # float32 [E, T]
    task: np.ndarray  # int [E]
    group: np.ndarray  # int [E]
    init_state: np.ndarray  # int [E]
    success: np.ndarray  # bool [E]
    crashed: np.ndarray  # bool [E]
    r_rec: np.ndarray  # float32 [E, T]


def read_inputs(g: zarr.Group, r_rec: np.ndarray) -> ShardRewardInputs:
    steps = store.read_step_table(g, ["valid", "r_task"])
    ep = store.read_episode_arrays(g, ["task", "group", "init_state", "success", "env_crashed"])
    return ShardRewardInputs(
        valid=steps["valid"],
        r_task=steps["r_task"],
        task=ep["task"].astype(np.int64),
        group=ep["group"].astype(np.int64),
        init_state=ep["init_state"].astype(np.int64),
        success=ep["success"],
        crashed=ep["env_crashed"],
        r_rec=r_rec,
    )


@dataclass
class RewardResult:
    arrays: list[dict[str, np.ndarray]]  # per shard: r_rec, r_rec_norm, reward, return, advantage
    group_kept: list[np.ndarray]  # per shard: bool [E]
    summary: dict[str, Any] = field(default_factory=dict)


def _global_groups(shards: list[ShardRewardInputs]) -> np.ndarray:
    """One id per (group, task, init_state) over all shards.

    A group's G members share task and init state; keying on all three keeps two groups
    apart even if shards numbered their groups independently, and joins a group whose
    members were split over shards.
    """
    keys = np.concatenate(
        [np.stack([s.group, s.task, s.init_state], axis=1) for s in shards], axis=0
    )
    _, ids = np.unique(keys, axis=0, return_inverse=True)
    return ids.reshape(-1)


def gammas_in_use(task: np.ndarray, rcfg: dict[str, Any]) -> dict[str, float]:
    """{config key: discount} for the suites present among the episodes' tasks."""
    is_long = np.isin(np.asarray(task), np.asarray(A.LIBERO_10_TASKS))
    out: dict[str, float] = {}
    if (~is_long).any():
        out["reward.gamma"] = float(rcfg["gamma"])
    if is_long.any():
        out["reward.gamma_libero_10"] = float(rcfg["gamma_libero_10"])
    return out


def check_success_dominates(shard_paths: list[Path], rcfg: dict[str, Any]) -> dict[str, float]:
    """Stop (ValueError) before any imagination or write if reconstruction reward could
    outweigh a success over the stores' horizon T (advantages.require_success_dominates).

    Reads only the shards' shapes and tasks; returns the margin per discount in use.
    """
    T, tasks = 0, []
    for path in shard_paths:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"no rollout store at {path}")
        # Not validated yet (that is the reward stage's next step): task and shape only.
        g = zarr.open_group(str(path), mode="r")
        T = max(T, store.step_shape(g)[1])
        tasks.append(store.read_episode_arrays(g, ["task"])["task"].astype(np.int64))
    task = np.concatenate(tasks) if tasks else np.zeros(0, np.int64)
    return A.require_success_dominates(
        float(rcfg["beta"]), float(rcfg["rec_clip"]), gammas_in_use(task, rcfg), T
    )


def rec_advantage_share(adv: np.ndarray, adv_beta0: np.ndarray, mask: np.ndarray) -> float | None:
    """mean|A - A_beta0| / mean|A| over `mask`: the share of the advantage that the
    reconstruction term moves (0 for beta = 0). None if there is no advantage to compare."""
    a, a0 = adv[mask].astype(np.float64), adv_beta0[mask].astype(np.float64)
    denom = float(np.abs(a).mean()) if a.size else 0.0
    return float(np.abs(a - a0).mean()) / denom if denom > 0 else None


def _pad_T(x: np.ndarray, T: int, fill: Any) -> np.ndarray:
    if x.shape[1] == T:
        return x
    pad = np.full((x.shape[0], T - x.shape[1], *x.shape[2:]), fill, dtype=x.dtype)
    return np.concatenate([x, pad], axis=1)


def compute_advantages(shards: list[ShardRewardInputs], rcfg: dict[str, Any]) -> RewardResult:
    """Normalise, combine, discount, group-normalise and filter over all shards together."""
    T = max(s.valid.shape[1] for s in shards)
    sizes = [s.valid.shape[0] for s in shards]
    valid = np.concatenate([_pad_T(s.valid, T, False) for s in shards])
    r_task = np.concatenate([_pad_T(s.r_task, T, 0.0) for s in shards])
    r_rec = np.concatenate([_pad_T(s.r_rec, T, 0.0) for s in shards])
    task = np.concatenate([s.task for s in shards])
    success = np.concatenate([s.success for s in shards])
    crashed = np.concatenate([s.crashed for s in shards])
    group = _global_groups(shards)
    # An env crash says nothing about the policy: its steps get rewards and returns but take
    # no part in the group comparison (advantage 0, so the actor skips them) or the filter.
    # group_kept must stay constant within a group, so it is not used to drop them.
    compared = valid & ~crashed[:, None]

    beta, clip = float(rcfg["beta"]), float(rcfg["rec_clip"])
    g_default, g_long = float(rcfg["gamma"]), float(rcfg["gamma_libero_10"])
    margins = A.require_success_dominates(beta, clip, gammas_in_use(task, rcfg), T)
    r_rec_norm, mean, std = A.normalise_rec(r_rec, valid)
    gamma = A.episode_gammas(task, g_default, g_long)
    reward = np.where(valid, A.combine(r_task, r_rec_norm, beta, gamma, clip), 0.0)
    reward = reward.astype(np.float32)
    returns = A.discounted_returns(reward, valid, gamma)
    scale = rcfg["adv_scale"]
    adv = A.group_advantages(returns, compared, group, scale=scale)
    # The same advantages without the reconstruction term, to report its share.
    returns_task = A.discounted_returns(np.where(valid, r_task, 0.0), valid, gamma)
    adv_beta0 = A.group_advantages(returns_task, compared, group, scale=scale)
    kept = np.zeros(group.shape[0], dtype=bool)
    ok = ~crashed
    kept_ok = A.degenerate_groups(
        success[ok],
        returns[ok],
        compared[ok],
        group[ok],
        rcfg["filter"],
        float(rcfg["zero_spread_eps"]),
    )
    for g in np.unique(group):  # a group of crashed episodes only is dropped
        members_ok = group[ok] == g
        kept[group == g] = bool(kept_ok[members_ok].any()) if members_ok.any() else False

    arrays, kept_list = [], []
    start = 0
    for s, n in zip(shards, sizes, strict=True):
        sl, Ts = slice(start, start + n), s.valid.shape[1]
        arrays.append(
            {
                "r_rec": np.where(s.valid, s.r_rec, 0.0).astype(np.float32),
                "r_rec_norm": r_rec_norm[sl, :Ts],
                "reward": reward[sl, :Ts],
                "return": returns[sl, :Ts],
                "advantage": adv[sl, :Ts],
            }
        )
        kept_list.append(kept[sl].copy())
        start += n
    groups_total = int(np.unique(group).size)
    groups_kept = int(np.unique(group[kept]).size)
    # Steps that carry an advantage into the actor: kept, compared, >= 2 live members.
    defined = compared & kept[:, None] & (A.live_members(compared, group) >= 2)
    z = r_rec_norm[valid]
    summary = {
        "beta": beta,
        "gamma": {"default": g_default, "libero_10": g_long},
        "rec_clip": clip,
        # The factor on clip(r~^rec) per suite: beta * (1 - gamma).
        "rec_scale": {"default": beta * (1.0 - g_default), "libero_10": beta * (1.0 - g_long)},
        "success_margin": margins,
        "horizon": T,
        "rec_mean": mean,
        "rec_std": std,
        "rec_clipped_share": float((np.abs(z) > clip).mean()) if z.size else 0.0,
        "rec_advantage_share": rec_advantage_share(adv, adv_beta0, defined),
        "adv_scale": scale,
        "filter": rcfg["filter"],
        "groups_kept": groups_kept,
        "groups_total": groups_total,
        "crashed_episodes": int(crashed.sum()),
        "episodes": int(sum(sizes)),
        "valid_steps": int(valid.sum()),
        "kept_steps": int((valid & kept[:, None]).sum()),
        "success_rate": float(success.mean()) if success.size else 0.0,
    }
    return RewardResult(arrays, kept_list, summary)


def run_reward(
    policy: Policy,
    shard_paths: list[Path],
    context: Tensor,
    context_mask: Tensor,
    cfg: dict[str, Any],
    world_model: dict[str, Any],
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Compute every shard's reward/ group and write it; returns the summary.

    world_model: {"kind": "live" | "frozen", "path": str, "sha256": str} for the attrs.
    Nothing is written until every shard's arrays are computed (a failure leaves the
    stores as they were).
    """
    rcfg = cfg["reward"]
    check_success_dominates(shard_paths, rcfg)  # before any imagination
    inputs, rollouts = [], []
    with progress_bar() as bar:
        for w, path in enumerate(shard_paths):
            g = store.open_rollout(path)  # the stage's one validation of the rollout's part
            rollouts.append(g)
            r_rec = reconstruction_rewards(
                policy,
                g,
                w,
                context,
                context_mask,
                int(rcfg["imagine_steps"]),
                int(cfg["seed"]),
                device,
                int(rcfg["imagine_batch"]),
                bar,
            )
            inputs.append(read_inputs(g, r_rec))
    result = compute_advantages(inputs, rcfg)
    for name, arrs in ((n, a) for n, a in zip(shard_paths, result.arrays, strict=True)):
        for k, v in arrs.items():
            if not np.isfinite(v).all():
                raise ValueError(f"non-finite reward/{k} in {name}; nothing was written")
    # The store adds this shard's own groups_kept / groups_total; keep the iteration's too.
    attrs = {
        **{k: v for k, v in result.summary.items() if k not in ("groups_kept", "groups_total")},
        "iteration_groups_kept": result.summary["groups_kept"],
        "iteration_groups_total": result.summary["groups_total"],
        "world_model": world_model,
        "config": cfg,  # what the actor checks its own reward settings against
    }
    for path, g, arrs, kept in zip(
        shard_paths, rollouts, result.arrays, result.group_kept, strict=True
    ):
        store.write_reward_group(path, arrs, kept, attrs, rollout=g)
    return {**result.summary, "world_model": world_model, "shards": [str(p) for p in shard_paths]}
