"""Init stage (iteration 0): the base policy, per-task text contexts and statistics.

Output iter_000/policy/: model.safetensors + policy.yaml (the backend), context.safetensors
(each of the 40 tasks' text context, computed once so rollout workers never load a text
encoder), stats.json (normalisation statistics), checkpoint.json (sha256, provenance).

policy.base_checkpoint: null = a fresh random model; `sft` = this run's sft/policy (the
SFT stage's output); else a policy directory (e.g. data/base_policy). A base directory's
own stats.json wins over policy.stats: a model is tied to the normalisation it learnt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from wamrl import paths
from wamrl.atomic import sha256_file
from wamrl.config import PolicySection, resolve_path, section
from wamrl.envs.conventions import Normalizer
from wamrl.envs.tasks import load_tasks
from wamrl.policy.checkpoint import read_policy_yaml, write_policy_dir
from wamrl.runtime import say_device


def check_base_matches(cfg_policy: dict[str, Any], base_dir: Path) -> None:
    """A base checkpoint brings its own dims; refuse one that contradicts the config's."""
    meta = read_policy_yaml(base_dir / paths.POLICY_YAML)
    if meta["backend"] != cfg_policy["backend"]:
        raise ValueError(
            f"policy.base_checkpoint {base_dir} is a {meta['backend']!r} model, "
            f"but policy.backend is {cfg_policy['backend']!r}"
        )
    wanted = cfg_policy.get(meta["backend"]) or {}
    have = meta["config"]
    differ = {k: (v, have[k]) for k, v in wanted.items() if k in have and have[k] != v}
    if differ:
        pairs = ", ".join(f"{k}: config {a} vs checkpoint {b}" for k, (a, b) in differ.items())
        raise ValueError(
            f"policy.base_checkpoint {base_dir} has other dims than policy.{meta['backend']} "
            f"({pairs}); set policy.base_checkpoint: null for a fresh model of these dims"
        )


def main(cfg: dict[str, Any], run_dir: Path, iteration: int = 0) -> None:
    from wamrl.policy import build_policy, load_policy
    from wamrl.policy.text import cached_task_contexts

    if iteration != 0:
        raise ValueError("init builds iteration 0 only")
    p = section(cfg, PolicySection)
    base = p.base_checkpoint
    base_dir = None
    if base is not None:
        base_dir = paths.sft_policy_dir(run_dir) if base == "sft" else resolve_path(base)
    stats = resolve_path(p.stats)
    if base_dir is not None and (base_dir / paths.STATS_FILE).is_file():
        stats = base_dir / paths.STATS_FILE
    Normalizer.load(stats)  # a missing or malformed stats file fails here, before any work
    if base_dir is not None:
        if not (base_dir / paths.MODEL_FILE).is_file():
            raise FileNotFoundError(f"policy.base_checkpoint: no {paths.MODEL_FILE} in {base_dir}")
        check_base_matches(cfg["policy"], base_dir)
        policy = load_policy(base_dir)
        source = {
            "base_checkpoint": str(base_dir),
            "sha256": sha256_file(base_dir / paths.MODEL_FILE),
        }
    else:
        torch.manual_seed(cfg["seed"])
        policy = build_policy(cfg)
        source = {"base_checkpoint": None, "random_init_seed": cfg["seed"]}

    # Built or loaded on the CPU: init only writes the checkpoint, and holds no GPU slot.
    say_device("init", "device cpu", "init writes the checkpoint only")
    tasks = load_tasks()
    if p.backend == "fastwam":  # umT5 contexts, Fast-WAM's prompt template
        from wamrl.policy.context import task_contexts

        context, mask = task_contexts(cfg, run_dir, tasks)
    else:
        context, mask = cached_task_contexts(
            [t.language for t in tasks],
            [t.name for t in tasks],
            p.tiny.text_max_len,
            paths.context_dir(run_dir),
        )
    write_policy_dir(
        paths.policy_dir(run_dir, 0),
        policy,
        ([t.name for t in tasks], context, mask),
        stats,
        {"iteration": 0, **source, "config": cfg},
    )
