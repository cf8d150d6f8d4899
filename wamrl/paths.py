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
