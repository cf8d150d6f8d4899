"""Which (task, init state) groups an iteration rolls out: hard-task oversampling.

The plan is a pure function of (config, iteration, recent success rates), so every rollout
shard computes the same plan and takes its own share of the groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from wamrl import paths
from wamrl.envs.tasks import Task
from wamrl.rollout import EpisodeSpec


def task_weights(success: np.ndarray, temperature: float) -> np.ndarray:
    """w_i ∝ exp(temperature · failure_rate_i): tasks that fail more are drawn more often."""
    logits = temperature * (1.0 - np.asarray(success, np.float64))
    w = np.exp(logits - logits.max())
    return w / w.sum()


def recent_success(run_dir: Path, iteration: int, tasks: list[Task]) -> np.ndarray:
    """Per-task success from the newest eval.json before `iteration`; unknown tasks count 0.5."""
    rate = np.full(len(tasks), 0.5)
    for it in range(iteration - 1, -1, -1):
        f = paths.eval_json(run_dir, it)
        if f.is_file():
            by_name = json.loads(f.read_text())["tasks"]
            for i, t in enumerate(tasks):
                if t.name in by_name:
                    rate[i] = by_name[t.name]["success_rate"]
            break
    return rate


def rollout_plan(
    cfg: dict, iteration: int, tasks: list[Task], success: np.ndarray
) -> list[EpisodeSpec]:
    """All episodes of the iteration, group by group (G consecutive specs share task and init)."""
    r = cfg["rollout"]
    rng = np.random.default_rng([cfg["seed"], iteration])
    weights = task_weights(success, r["oversample_temperature"])
    specs: list[EpisodeSpec] = []
    for g in range(r["groups"]):
        task = tasks[int(rng.choice(len(tasks), p=weights))]
        init_state = int(rng.integers(task.n_init_states))
        for _ in range(r["group_size"]):
            video = bool(rng.random() < r["video_sft_share"])
            specs.append(EpisodeSpec(task, init_state, g, record_video=video))
    return specs


def shard_specs(specs: list[EpisodeSpec], worker: int, workers: int) -> list[EpisodeSpec]:
    """Whole groups go to one shard: group g -> worker g mod W."""
    return [s for s in specs if s.group % workers == worker]
