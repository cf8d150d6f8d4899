"""Rollout stage: one worker's shard of the iteration's episodes.

Input iter_{n-1}/policy; output iter_n/rollouts/shard_{w}.zarr (written to a temporary
path and renamed when complete). Groups are planned identically by every worker (hard-task
oversampling from iteration n-1's rollout success, wamrl.plan) and group g goes to worker
g mod W; the plan's rates are recorded in the store's attrs["plan"].
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from wamrl import paths, tb
from wamrl.config import EnvSection, RolloutSection, SamplerSection, section
from wamrl.plan import make_plan, rollout_tasks, shard_specs
from wamrl.runtime import pick_device, set_gl_backend
from wamrl.seeding import derive_seed


def episode_limits(cfg: dict[str, Any], tasks) -> tuple[int, int]:
    """(T, Tv): macro-steps and env steps (+1 initial frame) of the longest episode."""
    env = section(cfg, EnvSection)
    replan, cap = env.replan_steps, env.max_macro_steps
    T = max(math.ceil(t.max_steps / replan) for t in tasks)
    if cap is not None:
        T = min(T, cap)
    return T, T * replan + 1


def main(cfg: dict[str, Any], run_dir: Path, iteration: int, worker: int) -> None:
    set_gl_backend(cfg)
    from wamrl.artifact import checkpoint_sha256
    from wamrl.envs.pool import EnvPool
    from wamrl.rollout import SamplerSettings, load_for_queries, run_episodes
    from wamrl.store import ShardWriter, read_episode_table

    if iteration < 1:
        raise ValueError("rollouts start at iteration 1 (iteration 0 is init)")
    r, env = section(cfg, RolloutSection), section(cfg, EnvSection)
    sampler = section(cfg, SamplerSection)
    W = r.workers
    if not 0 <= worker < W:
        raise ValueError(f"worker {worker} outside 0..{W - 1} (rollout.workers = {W})")
    run_dir = Path(run_dir)
    policy_dir = paths.policy_dir(run_dir, iteration - 1)
    if not (policy_dir / paths.MODEL_FILE).is_file():
        raise FileNotFoundError(f"no policy checkpoint at {policy_dir}")

    plan, plan_record = make_plan(cfg, run_dir, iteration, rollout_tasks(cfg))
    specs = shard_specs(plan, worker, W)
    T, Tv = episode_limits(cfg, [s.task for s in specs])
    device = pick_device(cfg, "rollout")
    torch.set_num_threads(1)  # the cores belong to the env processes
    attrs = {
        "iteration": iteration,
        "shard": worker,
        "G": r.group_size,
        "a": sampler.noise_a,
        "policy_checkpoint": str(policy_dir),
        "policy_sha256": checkpoint_sha256(policy_dir),
        "config": cfg,
        "plan": plan_record,  # the rates behind the plan: plan.plan_from_attrs recomputes it
    }
    env_cfg = dict(cfg["env"])  # the env processes take the section as a dict
    shard = paths.shard_path(run_dir, iteration, worker)
    # The pool first: its processes import LIBERO while this one loads the policy.
    with EnvPool(
        r.envs_per_worker, policy_dir / paths.STATS_FILE, env_cfg, seed=cfg["seed"]
    ) as pool:
        policy, context, mask, normalizer = load_for_queries(policy_dir, device)
        # Episodes are written by a background thread: written in this loop, each one's
        # compression (~0.12 s on the H100 box of bench/bench_iteration.py) held up every env
        # waiting for a query. Up to one episode per env may wait in its queue: a wave of
        # episodes ending together (the same step cap) does not block the loop, and memory
        # at most doubles the in-flight episodes' (tens of MB each).
        with ShardWriter(
            shard, len(specs), T, sampler.K, Tv, attrs, max_queued=r.envs_per_worker
        ) as writer:
            run_episodes(
                policy,
                pool,
                specs,
                context,
                mask,
                normalizer,
                SamplerSettings.from_config(sampler),
                env.max_macro_steps,
                seed=derive_seed(cfg["seed"], iteration, worker),
                on_episode=writer.write_episode,
                device=device,
                description=f"rollout iter {iteration} shard {worker}",
                # with each episode's own noise seed: a rerun gives the same bits
                fixed_batch=r.fixed_batch,
            )
    tb.log_scalars(
        run_dir,
        f"rollout_w{worker:03d}",
        iteration,
        lambda: tb.rollout_scalars(read_episode_table(shard)),
    )
