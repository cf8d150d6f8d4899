"""Where every artifact of a run lives (DESIGN.md "One iteration" and "Artifacts").

All paths are relative to the run directory, the folder Snakemake runs in.
"""

from __future__ import annotations

from pathlib import Path


def iter_dir(run_dir: Path, iteration: int) -> Path:
    return Path(run_dir) / f"iter_{iteration:03d}"


def policy_dir(run_dir: Path, iteration: int) -> Path:
    """A complete policy checkpoint: model.safetensors, policy.yaml, context.safetensors, stats.json."""
    return iter_dir(run_dir, iteration) / "policy"


def shard_path(run_dir: Path, iteration: int, worker: int) -> Path:
    return iter_dir(run_dir, iteration) / "rollouts" / f"shard_{worker:03d}.zarr"


def shard_paths(run_dir: Path, iteration: int, workers: int) -> list[Path]:
    return [shard_path(run_dir, iteration, w) for w in range(workers)]


def reward_done(run_dir: Path, iteration: int) -> Path:
    return iter_dir(run_dir, iteration) / "reward.done"


def actor_dir(run_dir: Path, iteration: int) -> Path:
    return iter_dir(run_dir, iteration) / "actor"


def world_model_dir(run_dir: Path, iteration: int) -> Path:
    return iter_dir(run_dir, iteration) / "world_model"


def eval_json(run_dir: Path, iteration: int) -> Path:
    return iter_dir(run_dir, iteration) / "eval.json"


def eval_videos_dir(run_dir: Path, iteration: int) -> Path:
    return iter_dir(run_dir, iteration) / "eval_videos"


def stage_outputs(
    stage: str, run_dir: Path, iteration: int = 0, worker: int = 0, workers: int = 1
) -> list[Path]:
    """What a stage writes (the paths it alone owns), so that it can settle the leftovers
    of a killed earlier run of itself before it starts (atomic.settle): each path's own
    .NAME.tmp-* and .NAME.old-*, nothing else. The reward stage owns reward/ in every shard."""
    run_dir = Path(run_dir)
    if stage == "rollout":
        return [shard_path(run_dir, iteration, worker)]
    if stage == "reward":
        shards = shard_paths(run_dir, iteration, workers)
        return [reward_done(run_dir, iteration), *(s / "reward" for s in shards)]
    if stage == "actor":
        return [actor_dir(run_dir, iteration)]
    if stage == "world_model":
        return [world_model_dir(run_dir, iteration)]
    if stage in ("merge", "init"):
        return [policy_dir(run_dir, iteration)]
    if stage == "eval":
        return [eval_json(run_dir, iteration), eval_videos_dir(run_dir, iteration)]
    if stage == "demos":
        return [run_dir / "demos" / f"shard_{worker:03d}.zarr"]
    if stage == "sft":
        sft = run_dir / "sft"
        return [sft / "policy", sft / "snapshot", sft / "log.json"]
    raise ValueError(f"unknown stage {stage!r}")
