"""Which (task, init state) groups an iteration rolls out: hard-task oversampling.

The plan is a pure function of (config, iteration, per-task success rates), and the rates
come only from the rollout stage's declared inputs: the previous iteration's rollout
stores (the Snakefile lists them as `ancient` inputs of the rollout rule). Iteration 1 has
none and draws tasks uniformly. So every shard computes the same plan, a rerun computes it
again, and `plan_from_attrs` recomputes it from what a store records in `attrs["plan"]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wamrl import paths
from wamrl.envs.tasks import Task, load_tasks, tasks_in_suites
from wamrl.seeding import derive_seed

PRIOR = 0.5  # (successes + PRIOR) / (episodes + 2 PRIOR): an unseen task counts 0.5


@dataclass(frozen=True)
class EpisodeSpec:
    """What to run, decided before the episode starts."""

    task: Task
    init_state: int
    group: int
    record_video: bool = False
    # x_0 (and with a > 0, k* and the SDE noise) drawn from this seed's own generator, so an
    # episode's numbers do not depend on its env or batch (eval and rollout plans set it)
    noise_seed: int | None = None
    # eval.protocol official: the generator is reseeded with noise_seed before every query, so
    # every query starts from the same x_0 (Fast-WAM's eval: seed 42 at every infer_action)
    reseed_each_query: bool = False


def task_weights(success: np.ndarray, temperature: float) -> np.ndarray:
    """w_i ∝ exp(temperature · failure_rate_i): tasks that fail more are drawn more often."""
    logits = temperature * (1.0 - np.asarray(success, np.float64))
    w = np.exp(logits - logits.max())
    return w / w.sum()


def smoothed_rates(successes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(s + 0.5) / (n + 1) per task: 0.5 for a task with no episodes, and a task seen once
    moves only part of the way to 0 or 1 (one episode is weak evidence)."""
    s, n = np.asarray(successes, np.float64), np.asarray(counts, np.float64)
    return (s + PRIOR) / (n + 2 * PRIOR)


def previous_rollout_counts(
    run_dir: Path, iteration: int, tasks: list[Task], workers: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(successes, episodes) per task over iteration n-1's rollout stores, and the stores
    read (relative to run_dir). Iteration 1 has none: zeros. Crashed envs are left out:
    a crash says nothing about the policy."""
    successes = np.zeros(len(tasks), np.int64)
    counts = np.zeros(len(tasks), np.int64)
    if iteration <= 1:
        return successes, counts, []
    from wamrl.store import read_plan_table  # late: keeps `wamrl.plan` import light

    pos = {t.index: i for i, t in enumerate(tasks)}
    sources = []
    for path in paths.shard_paths(run_dir, iteration - 1, workers):
        task, success, crashed = read_plan_table(path)
        for t, s in zip(task[~crashed].tolist(), success[~crashed].tolist(), strict=True):
            if t in pos:
                counts[pos[t]] += 1
                successes[pos[t]] += int(s)
        sources.append(str(Path(path).relative_to(run_dir)))
    return successes, counts, sources


def systematic_draw(weights: np.ndarray, n: int, rng: np.random.Generator) -> list[int]:
    """n task indices in which task i appears floor(n w_i) or ceil(n w_i) times (systematic
    sampling: one uniform offset, n evenly spaced points on the weights' CDF), in random order.
    Unlike n independent draws, every task with n w_i >= 1 is in the iteration: at uniform
    weights and n = len(weights), each task exactly once."""
    cdf = np.cumsum(np.asarray(weights, np.float64))
    points = (rng.random() + np.arange(n)) / n * cdf[-1]
    picks = np.minimum(np.searchsorted(cdf, points, side="right"), len(cdf) - 1)
    return [int(i) for i in rng.permutation(picks)]


def rollout_tasks(cfg: dict[str, Any]) -> list[Task]:
    """The tasks the plan draws from: rollout.suites' tasks, or those of them rollout.tasks
    names (validated on load to be a non-empty subset; one task is single-task RL)."""
    r = cfg["rollout"]
    tasks = tasks_in_suites(r["suites"])
    return tasks if r["tasks"] is None else [t for t in tasks if t.index in set(r["tasks"])]


def rollout_plan(
    cfg: dict, iteration: int, tasks: list[Task], success: np.ndarray, draw: str = "systematic"
) -> list[EpisodeSpec]:
    """All episodes of the iteration, group by group (G consecutive specs share task and init).

    draw: how the groups' tasks are drawn from task_weights: "systematic" (systematic_draw;
    make_plan's, recorded in attrs.plan.draw) or "independent" (one draw per group, with
    replacement: at 10 groups and 10 tasks an iteration saw 5 to 8 of them; the plan of
    stores without attrs.plan.draw).
    Each episode gets its own noise seed from (seed, iteration, group, member), so its x_0,
    k* and SDE noise do not depend on which env or batch it runs in (wamrl.rollout)."""
    r = cfg["rollout"]
    rng = np.random.default_rng([cfg["seed"], iteration])
    weights = task_weights(success, r["oversample_temperature"])
    if draw not in ("systematic", "independent"):
        raise ValueError(f"unknown task draw {draw!r}: systematic | independent")
    drawn = systematic_draw(weights, r["groups"], rng) if draw == "systematic" else None
    specs: list[EpisodeSpec] = []
    for g in range(r["groups"]):
        i = drawn[g] if drawn is not None else int(rng.choice(len(tasks), p=weights))
        task = tasks[i]
        init_state = int(rng.integers(task.n_init_states))
        for m in range(r["group_size"]):
            video = bool(rng.random() < r["video_sft_share"])
            seed = episode_seed(cfg["seed"], iteration, g, m)
            specs.append(EpisodeSpec(task, init_state, g, record_video=video, noise_seed=seed))
    return specs


def episode_seed(seed: int, iteration: int, group: int, member: int) -> int:
    """The noise seed of one rollout episode (a 32-bit value of a SeedSequence)."""
    return derive_seed(seed, iteration, group, member)


def shard_specs(specs: list[EpisodeSpec], worker: int, workers: int) -> list[EpisodeSpec]:
    """Whole groups go to one shard: group g -> worker g mod W."""
    return [s for s in specs if s.group % workers == worker]


def make_plan(
    cfg: dict[str, Any], run_dir: Path, iteration: int, tasks: list[Task]
) -> tuple[list[EpisodeSpec], dict[str, Any]]:
    """The iteration's whole plan and what a store records of it (`attrs["plan"]`)."""
    W = int(cfg["rollout"]["workers"])
    successes, counts, sources = previous_rollout_counts(run_dir, iteration, tasks, W)
    rates = smoothed_rates(successes, counts)
    record = {
        "source": sources,  # [] at iteration 1: uniform
        "tasks": [t.index for t in tasks],
        "successes": successes.tolist(),
        "episodes": counts.tolist(),
        "rates": rates.tolist(),
        "temperature": float(cfg["rollout"]["oversample_temperature"]),
        "draw": "systematic",
        "seed": int(cfg["seed"]),
        "iteration": int(iteration),
        "groups": int(cfg["rollout"]["groups"]),
        "group_size": int(cfg["rollout"]["group_size"]),
        "video_sft_share": float(cfg["rollout"]["video_sft_share"]),
        "workers": W,
    }
    return rollout_plan(cfg, iteration, tasks, rates), record


def plan_from_attrs(attrs: dict[str, Any], worker: int | None = None) -> list[EpisodeSpec]:
    """Recompute a plan from a store's attrs["plan"] (all shards', or one worker's)."""
    p = attrs["plan"]
    table = load_tasks()
    cfg = {
        "seed": p["seed"],
        "rollout": {
            "groups": p["groups"],
            "group_size": p["group_size"],
            "video_sft_share": p["video_sft_share"],
            "oversample_temperature": p["temperature"],
        },
    }
    tasks = [table[i] for i in p["tasks"]]
    draw = p.get("draw", "independent")  # stores made before attrs.plan.draw: independent
    specs = rollout_plan(cfg, p["iteration"], tasks, np.array(p["rates"]), draw)
    return specs if worker is None else shard_specs(specs, worker, p["workers"])
