"""SFT stage: demos/shard_*.zarr -> sft/policy (a complete policy checkpoint) + sft/log.json.

Statistics in Fast-WAM's format are computed from the demonstrations and go with the
checkpoint (stats.json): the policy's normalisation is the one it was trained with.
The `init` rule starts from this checkpoint when policy.base_checkpoint is `sft`.
With sft.save_every, sft/snapshot holds the latest intermediate checkpoint (same layout)
until the run finishes: a run cut off by a job limit still leaves a usable policy.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from wamrl import paths
from wamrl.atomic import write_json
from wamrl.config import DemosSection, PolicySection, SftSection, section
from wamrl.policy.checkpoint import write_policy_dir


def main(cfg: dict[str, Any], run_dir: Path) -> None:
    from wamrl.demos import demo_stats, load_demos
    from wamrl.envs.conventions import Normalizer
    from wamrl.envs.tasks import load_tasks
    from wamrl.policy import build_policy
    from wamrl.policy.text import cached_task_contexts
    from wamrl.progress import progress_bar
    from wamrl.runtime import pick_device
    from wamrl.sft import Batches, train

    run_dir = Path(run_dir)
    shards = paths.demos_shards(run_dir, section(cfg, DemosSection).workers)
    missing = [str(p) for p in shards if not p.exists()]
    if missing:
        raise FileNotFoundError(f"sft: demo stores missing: {missing}")
    t0 = time.perf_counter()
    demos = load_demos(shards)  # a half-written or foreign store fails here
    stats = demo_stats(demos)
    norm = Normalizer(stats)
    tasks = load_tasks()
    context, mask = cached_task_contexts(
        [t.language for t in tasks],
        [t.name for t in tasks],
        section(cfg, PolicySection).tiny.text_max_len,
        paths.context_dir(run_dir),
    )
    device = pick_device(cfg, "sft")
    torch.manual_seed(cfg["seed"])
    policy = build_policy(cfg).to(device)
    batches = Batches(demos, norm, context, mask, device, section(cfg, SftSection).augment_shift)

    def save(out: Path, step: int) -> None:
        record = {
            "source": "sft",
            "sft_steps": step,
            "demo_episodes": len(demos),
            "demo_stores": [str(p) for p in shards],
            "config": cfg,
        }
        write_policy_dir(out, policy, ([t.name for t in tasks], context, mask), stats, record)

    snapshot = paths.sft_snapshot_dir(run_dir)
    with progress_bar() as bar:  # wamrl.sft.train reads the sft section as a dict
        log = train(
            policy, batches, cfg["sft"], cfg["seed"], progress=bar,
            on_snapshot=lambda step: save(snapshot, step),
        )  # fmt: skip
    save(paths.sft_policy_dir(run_dir), log[-1]["step"] + 1)
    shutil.rmtree(snapshot, ignore_errors=True)  # superseded by the finished policy
    write_json(
        paths.sft_log(run_dir),
        {"wall_time_s": time.perf_counter() - t0, "episodes": len(demos), "log": log},
    )
