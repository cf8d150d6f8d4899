"""Checkpoints: safetensors + policy.yaml, no pickle. Mismatches name the tensor and the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from torch import Tensor, nn

from wamrl.artifact import load_tensors, save_tensors


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
