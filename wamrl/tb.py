"""TensorBoard scalars of a run: each stage writes its numbers under RUN_DIR/tb/<name>/.

`tensorboard --logdir RUN_DIR/tb` then shows the run live. Each stage run writes one event
file (torch.utils.tensorboard, a maintained writer) with global step = iteration, in a
subdirectory of its own (`actor`, `eval`, `rollout_w000`, ...): TensorBoard reads the files
of one directory in order and assumes only the newest still grows, so concurrent stages
(rollout workers next to each other) must not share one.

Logging is a side channel: any failure (no tensorboard, read-only disk, a metric missing)
is a warning, never a failed stage.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

TB_DIR = "tb"
_REPO_ROOT = Path(__file__).resolve().parents[1]

Scalars = Mapping[str, float | int | None]


def log_scalars(
    run_dir: str | Path,
    name: str,
    iteration: int,
    scalars: Scalars | Callable[[], Scalars],
) -> Path | None:
    """Write `scalars` (tag -> value; None and non-finite values are skipped) at step
    `iteration` to RUN_DIR/tb/<name>/. A callable is evaluated here, so that a metric that
    cannot be computed is also only a warning. Returns the log dir, or None on failure."""
    try:
        run = Path(run_dir).resolve()
        # A stage run from the checkout itself (run dir ".") must not litter the source tree.
        if run == _REPO_ROOT:
            warnings.warn("tb: run dir is the source tree; no TensorBoard scalars", stacklevel=2)
            return None
        values = scalars() if callable(scalars) else scalars
        from torch.utils.tensorboard import SummaryWriter

        log_dir = run / TB_DIR / name
        # The suffix names the stage and step in the file name: readable by a person
        # listing the folder; the writer already makes it unique (time, host, pid).
        writer = SummaryWriter(log_dir=str(log_dir), filename_suffix=f".{name}.{iteration:03d}")
        try:
            for tag, v in values.items():
                if v is not None and math.isfinite(float(v)):
                    writer.add_scalar(tag, float(v), global_step=int(iteration))
        finally:
            writer.close()
        return log_dir
    except Exception as e:  # a side channel must never fail a stage
        warnings.warn(f"tb: could not write TensorBoard scalars for {name}: {e!r}", stacklevel=2)
        return None


def _get(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def rollout_scalars(table: Mapping[str, np.ndarray]) -> dict[str, float | None]:
    """One shard's episode table (store.read_episode_table). Named `shard_*`: the rate over
    all shards is `rollout/success`, written by the reward stage."""
    success = np.asarray(table["success"], bool)
    n = len(success)
    return {
        "rollout/shard_success": float(success.mean()) if n else None,
        "rollout/shard_episodes": n,
        "rollout/shard_mean_length": float(np.mean(table["length"])) if n else None,
        "rollout/shard_env_crashed": int(np.sum(table["env_crashed"])),
    }


def reward_scalars(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """The reward stage's summary (what reward.done holds)."""
    kept, total = _get(summary, "groups_kept"), _get(summary, "groups_total")
    return {
        "rollout/success": _get(summary, "success_rate"),
        "rollout/episodes": _get(summary, "episodes"),
        "reward/groups_kept": kept,
        "reward/groups_total": total,
        "reward/groups_kept_share": kept / total if kept is not None and total else None,
        "reward/rec_mean": _get(summary, "rec_mean"),
        "reward/rec_std": _get(summary, "rec_std"),
        "reward/rec_advantage_share": _get(summary, "rec_advantage_share"),
        "reward/rec_clipped_share": _get(summary, "rec_clipped_share"),
        "reward/kept_steps": _get(summary, "kept_steps"),
    }


def actor_scalars(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """actor/metrics.json. Per-epoch numbers are the last epoch's: where the update ended."""
    epochs = metrics.get("epochs") or [{}]
    last = epochs[-1]
    out: dict[str, float | None] = {
        "actor/kl": _get(metrics, "kl"),
        "actor/approx_kl": _get(last, "approx_kl"),
        "actor/clip_fraction": _get(last, "clip_fraction"),
        "actor/ratio_mean": _get(last, "ratio_mean"),
        "actor/grad_norm": _get(last, "grad_norm"),
        "actor/loss": _get(last, "loss"),
        "actor/epochs": len(metrics.get("epochs") or []),
        "actor/early_stop": 1.0 if metrics.get("early_stop") else 0.0,
        "actor/steps": _get(metrics, "steps"),
    }
    for k, v in (metrics.get("kl_by_k_star") or {}).items():
        out[f"actor/kl_k{k}"] = float(v) if v is not None else None
    for t, v in (metrics.get("kl_by_task") or {}).items():
        out[f"actor/kl_task{t}"] = float(v) if v is not None else None
    return out


def world_model_scalars(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """world_model/metrics.json."""
    return {
        f"world_model/{k}": _get(metrics, k)
        for k in ("video_loss", "kl", "loss", "grad_norm", "windows", "successful_video_episodes")
    }


def eval_scalars(report: Mapping[str, Any]) -> dict[str, float | None]:
    """eval.json: per-suite rates and the average over tasks."""
    out: dict[str, float | None] = {
        f"eval/{s}": float(v) for s, v in (report.get("suites") or {}).items()
    }
    out["eval/average"] = _get(report, "average")
    out["eval/env_crashed"] = _get(report, "env_crashed")
    out["eval/wall_time_s"] = _get(report, "wall_time_s")
    return out
