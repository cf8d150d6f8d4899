"""Checkpoints: safetensors + policy.yaml, no pickle. Mismatches name the tensor and the file."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from torch import Tensor, nn

from wamrl.artifact import checkpoint_hashes, load_tensors, save_tensors
from wamrl.atomic import atomic_dir, write_json
from wamrl.paths import CHECKPOINT_FILE, CONTEXT_FILE, STATS_FILE

if TYPE_CHECKING:
    from wamrl.policy.base import Policy


def save_state(state: dict[str, Tensor], path: Path) -> None:
    save_tensors({k: v.detach().contiguous().cpu() for k, v in state.items()}, path)


def load_state(model: nn.Module, path: Path) -> None:
    state = load_tensors(path, "checkpoint")
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"{path}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(
                f"{path}: tensor {k} has shape {tuple(v.shape)}, model expects {tuple(own[k].shape)}"
            )
    model.load_state_dict(state, strict=True)


def write_policy_yaml(path: Path, backend: str, config: dict[str, Any]) -> None:
    Path(path).write_text(yaml.safe_dump({"backend": backend, "config": config}, sort_keys=False))


def read_policy_yaml(path: Path, backend: str | None = None) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"policy config not found: {path}")
    meta = yaml.safe_load(path.read_text())
    if not isinstance(meta, dict) or "backend" not in meta or "config" not in meta:
        raise ValueError(f"{path}: expected keys 'backend' and 'config'")
    if backend is not None and meta["backend"] != backend:
        raise ValueError(f"{path}: backend is {meta['backend']!r}, expected {backend!r}")
    return meta


def write_policy_dir(
    out: Path,
    policy: Policy,
    contexts: Path | tuple[Sequence[str], Tensor, Tensor],
    stats: Path | Mapping[str, Any],
    record: Mapping[str, Any],
) -> None:
    """Write a complete policy directory at `out`, atomically: the model (policy.save),
    context.safetensors, stats.json and checkpoint.json (the sha256 of every file, then
    `record`: iteration, provenance, config).

    contexts: a context.safetensors to copy, or (task names, context, mask) to save;
    stats: a stats.json to copy, or the statistics to write. The hashes are taken when
    every other file is in place, so load_policy can check each one before use.
    """
    from wamrl.policy.text import save_contexts

    with atomic_dir(out) as tmp:
        policy.save(tmp)
        if isinstance(contexts, Path):
            shutil.copy2(contexts, tmp / CONTEXT_FILE)
        else:
            names, context, mask = contexts
            save_contexts(tmp / CONTEXT_FILE, list(names), context, mask)
        if isinstance(stats, Path):
            shutil.copy2(stats, tmp / STATS_FILE)
        else:
            write_json(tmp / STATS_FILE, stats)
        write_json(tmp / CHECKPOINT_FILE, {**checkpoint_hashes(tmp), **record})
