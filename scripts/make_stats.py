"""Measure bootstrap normalisation statistics (data/stats.json) in Fast-WAM's format.

These are NOT demonstration statistics. Until the real dataset's statistics file is
dropped in (it ships with a Fast-WAM checkpoint), the tiny backend needs some min/max to
map proprio and actions to [-1, 1]. We measure them:
- state: raw proprio (eef_pos, axis-angle(eef_quat), gripper_qpos) over short exploration
  runs in a few scenes of every suite;
- action: the executed OSC_POSE deltas of that exploration (a smooth random walk bounded
  by EXPLORE_BOUND per dim, clipped to the controller's [-1, 1] input range), the gripper
  written in the data's convention (1 = open, 0 = closed; see conventions.gripper_from_env).

    MUJOCO_GL=egl python scripts/make_stats.py [--out data/stats.json] [--steps 120]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Two tasks per suite (table indices): different scenes, tables and robot mounts.
TASK_INDICES = [0, 5, 10, 15, 20, 27, 30, 36]
# Exploration bound per action dim (translation, rotation, gripper command).
EXPLORE_BOUND = np.array([1.0, 1.0, 1.0, 0.5, 0.5, 0.5])


def _explore(args: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    task_index, steps, seed = args
    os.environ.setdefault("MUJOCO_GL", "egl")
    from wamrl.envs.conventions import gripper_from_env
    from wamrl.envs.libero_env import LiberoEnv
    from wamrl.envs.tasks import load_tasks

    task = load_tasks()[task_index]
    rng = np.random.default_rng(seed)
    env = LiberoEnv(task, seed=seed)
    env.reset(int(rng.integers(task.n_init_states)))
    states, actions = [env.proprio()], []
    delta = np.zeros(6)
    grip = -1.0
    for _ in range(steps):
        # AR(1) random walk: smooth enough to move the arm somewhere instead of jittering.
        delta = 0.8 * delta + 0.6 * rng.normal(size=6) * EXPLORE_BOUND
        delta = np.clip(delta, -EXPLORE_BOUND, EXPLORE_BOUND)
        if rng.random() < 0.05:
            grip = -grip
        action = np.r_[delta, grip]
        env.step(action)
        states.append(env.proprio())
        actions.append(np.r_[delta, gripper_from_env(grip)])
    env.close()
    return np.stack(states), np.stack(actions)


def main() -> None:
    from wamrl.envs.conventions import stats_entry

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "stats.json")
    parser.add_argument("--steps", type=int, default=120, help="exploration env steps per scene")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    jobs = [(ti, args.steps, args.seed + k) for k, ti in enumerate(TASK_INDICES)]
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as ex:
        runs = list(ex.map(_explore, jobs))
    states = np.concatenate([s for s, _ in runs]).astype(np.float64)
    actions = np.concatenate([a for _, a in runs]).astype(np.float64)
    doc = {
        "source": (
            "BOOTSTRAP statistics measured by scripts/make_stats.py, not demonstration "
            "statistics: replace with the dataset's stats file of the Fast-WAM checkpoint. "
            f"state: raw proprio over {len(states)} states from random OSC_POSE exploration "
            f"in tasks {TASK_INDICES} ({args.steps} steps each, seed {args.seed}); action: the "
            f"executed deltas (smooth random walk, bound {EXPLORE_BOUND.tolist()}), gripper in "
            "data convention 1 = open, 0 = closed."
        ),
        "state": {"libero_proprio": stats_entry(states)},
        "action": {"libero_osc_pose": stats_entry(actions)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out} from {len(states)} states in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
