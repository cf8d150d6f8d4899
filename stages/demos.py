"""Demos stage: one worker's share of scripted-expert episodes -> demos/shard_{w}.zarr.

Attempts are (task, init state) for every task of demos.suites that has an expert and
demos.init_states init states from demos.first_init_state on (as many as LIBERO has), split
over the W workers in contiguous blocks. Only successful episodes are stored; the store's
attrs keep every attempt's outcome (the expert table).
With demos.action_noise > 0 the env executes noisy expert actions (wamrl.demos.record).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from wamrl import paths
from wamrl.config import DemosSection, EnvSection, section
from wamrl.envs.tasks import Task, tasks_in_suites
from wamrl.runtime import set_gl_backend


def attempts(cfg: dict[str, Any], worker: int) -> list[tuple[Task, int]]:
    from wamrl.experts import SUPPORTED

    d = section(cfg, DemosSection)
    tasks = [t for t in tasks_in_suites(d.suites) if t.index in SUPPORTED]
    if d.tasks is not None:
        tasks = [t for t in tasks if t.index in set(d.tasks)]
    first = d.first_init_state
    pairs = [
        (t, i) for t in tasks for i in range(first, min(first + d.init_states, t.n_init_states))
    ]
    W = d.workers  # contiguous blocks: a worker makes few envs (4-8 s each on CPU)
    return pairs[worker * len(pairs) // W : (worker + 1) * len(pairs) // W]


def main(cfg: dict[str, Any], run_dir: Path, worker: int) -> None:
    set_gl_backend(cfg)
    from wamrl.demos import record, write_demo_store
    from wamrl.envs.libero_env import LiberoEnv
    from wamrl.experts import make_expert
    from wamrl.progress import progress_bar

    d = section(cfg, DemosSection)
    W = d.workers
    if not 0 <= worker < W:
        raise ValueError(f"worker {worker} outside 0..{W - 1} (demos.workers = {W})")
    todo = attempts(cfg, worker)
    if not todo:
        raise ValueError(f"demos worker {worker}: no (task, init state) to record")
    e = section(cfg, EnvSection)
    demos, table = [], []
    t0 = time.perf_counter()
    env = None
    with progress_bar() as bar:
        job = bar.add_task(f"demos {worker}", total=len(todo), info="")
        for task, init in todo:
            if env is None or env.task.index != task.index:
                if env is not None:
                    env.close()
                env = LiberoEnv(
                    task, e.render_size, e.settle_steps, seed=cfg["seed"],
                    model_cache=e.model_cache,
                )  # fmt: skip
            rng = np.random.default_rng([cfg["seed"], task.index, init])  # per attempt
            demo, steps = record(env, make_expert(task), init, task.max_steps, d.action_noise, rng)
            table.append({"task": task.index, "init_state": init, "success": demo is not None,
                          "steps": steps})  # fmt: skip
            if demo is not None:
                demos.append(demo)
            ok = sum(r["success"] for r in table)
            bar.update(job, advance=1, info=f"{task.name[:40]}  ok {ok}/{len(table)}")
    if env is not None:
        env.close()
    write_demo_store(
        paths.demos_shard(run_dir, worker),
        demos,
        {
            "worker": worker,
            "attempts": table,
            "wall_time_s": time.perf_counter() - t0,
            "config": cfg,
        },
    )
