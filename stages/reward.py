"""Reward stage: imagined-future rewards, returns and advantages into every shard's reward/.

Inputs: iter_n/rollouts/shard_*.zarr and the world model (live = iter_{n-1}/policy,
frozen = iter_000/policy). Outputs: group reward/ in each shard, then iter_n/reward.done
(written last: its existence means every shard has a complete reward/ group).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wamrl import paths, store, tb
from wamrl.artifact import checkpoint_sha256
from wamrl.atomic import write_json
from wamrl.config import RewardSection, RolloutSection, section
from wamrl.reward import check_success_dominates, run_reward
from wamrl.runtime import pick_device


def world_model_dir(cfg: dict[str, Any], run_dir: Path, iteration: int) -> tuple[str, Path]:
    kind = section(cfg, RewardSection).world_model
    if kind == "live":
        return kind, paths.policy_dir(run_dir, iteration - 1)
    if kind == "frozen":
        return kind, paths.policy_dir(run_dir, 0)
    raise ValueError(f"reward.world_model must be live or frozen, got {kind!r}")


def main(cfg: dict[str, Any], run_dir: Path, iteration: int) -> None:
    from wamrl.policy import load_policy
    from wamrl.policy.text import load_contexts

    if iteration < 1:
        raise ValueError("the reward stage runs for iterations >= 1 (iteration 0 is init)")
    run_dir = Path(run_dir)
    device = pick_device(cfg, "reward")
    kind, wm_dir = world_model_dir(cfg, run_dir, iteration)
    shards = paths.shard_paths(run_dir, iteration, section(cfg, RolloutSection).workers)
    store.check_made_under(shards, cfg)  # e.g. every shard rolled out with this G
    # A reward that lets reconstruction outweigh success stops here: no model load, no write.
    check_success_dominates(shards, cfg["reward"])
    policy = load_policy(wm_dir, device=device)
    context, mask = load_contexts(wm_dir / paths.CONTEXT_FILE)
    world_model = {"kind": kind, "path": str(wm_dir), "sha256": checkpoint_sha256(wm_dir)}
    # reward.done vouches for every shard's reward/ group, which this run now rewrites: a
    # run killed halfway through the shards must not leave the old marker standing.
    paths.reward_done(run_dir, iteration).unlink(missing_ok=True)
    summary = run_reward(policy, shards, context, mask, cfg, world_model, device)
    summary["shards"] = [str(s.relative_to(run_dir)) for s in shards]
    write_json(
        paths.reward_done(run_dir, iteration), {"iteration": iteration, **summary, "config": cfg}
    )
    tb.log_scalars(run_dir, "reward", iteration, lambda: tb.reward_scalars(summary))
