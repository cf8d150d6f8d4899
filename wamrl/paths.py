"""Where every artifact of a run lives (docs/design.md "One iteration" and "Artifacts").

All paths are relative to the run directory, the folder Snakemake runs in. The file names
inside an artifact directory are constants here, so that the stage writing a file and every
reader of it cannot drift apart.
"""

from __future__ import annotations

from pathlib import Path

# A policy directory (iter_NNN/policy, sft/policy, a base checkpoint such as data/base_policy).
MODEL_FILE = "model.safetensors"
POLICY_YAML = "policy.yaml"
CONTEXT_FILE = "context.safetensors"  # each task's text context, in task-table order
STATS_FILE = "stats.json"  # normalisation statistics in Fast-WAM's format
# Every checkpoint directory (policy, actor, world model): the sha256 of each file + provenance.
CHECKPOINT_FILE = "checkpoint.json"
# actor/
ACTOR_FILE = "actor.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
MASTER_FILE = "master.safetensors"
# world_model/
LORA_FILE = "lora.safetensors"
SIGMA_REF_FILE = "sigma_ref.safetensors"
EMA_FILE = "ema.safetensors"
# actor/ and world_model/: the update's metrics with the resolved config
METRICS_FILE = "metrics.json"
EVAL_FILE = "eval.json"  # an iteration's eval, also shipped beside a base checkpoint
# <run>/context/: the text contexts computed once per run (and their record)
CONTEXT_DIR = "context"
CONTEXT_JSON = "context.json"


def iter_dir(run_dir: Path, iteration: int) -> Path:
    return Path(run_dir) / f"iter_{iteration:03d}"


def policy_dir(run_dir: Path, iteration: int) -> Path:
    """A complete policy checkpoint: model.safetensors, policy.yaml, context.safetensors,
    stats.json, checkpoint.json."""
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
    return iter_dir(run_dir, iteration) / EVAL_FILE


def eval_videos_dir(run_dir: Path, iteration: int) -> Path:
    return iter_dir(run_dir, iteration) / "eval_videos"


def demos_shard(run_dir: Path, worker: int) -> Path:
    return Path(run_dir) / "demos" / f"shard_{worker:03d}.zarr"


def demos_shards(run_dir: Path, workers: int) -> list[Path]:
    return [demos_shard(run_dir, w) for w in range(workers)]


def sft_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "sft"


def sft_policy_dir(run_dir: Path) -> Path:
    """The SFT stage's policy checkpoint (policy.base_checkpoint: sft starts from it)."""
    return sft_dir(run_dir) / "policy"


def sft_snapshot_dir(run_dir: Path) -> Path:
    """The latest intermediate SFT checkpoint, until the finished one supersedes it."""
    return sft_dir(run_dir) / "snapshot"


def sft_log(run_dir: Path) -> Path:
    return sft_dir(run_dir) / "log.json"


def context_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CONTEXT_DIR


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
        return [demos_shard(run_dir, worker)]
    if stage == "sft":
        return [sft_policy_dir(run_dir), sft_snapshot_dir(run_dir), sft_log(run_dir)]
    if stage == "context":
        return [context_dir(run_dir)]
    raise ValueError(f"unknown stage {stage!r}")
