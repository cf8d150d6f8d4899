"""Policy backends behind one interface (wamrl.policy.base.Policy), chosen by config name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from wamrl.artifact import verify_checkpoint
from wamrl.policy.base import Obs, Policy
from wamrl.policy.checkpoint import read_policy_yaml

__all__ = ["Obs", "Policy", "build_policy", "load_policy"]


def _backends() -> dict[str, type[Policy]]:
    from wamrl.policy.fastwam import FastWAMPolicy
    from wamrl.policy.tiny import TinyWAM

    return {"tiny": TinyWAM, "fastwam": FastWAMPolicy}


def build_policy(cfg: dict[str, Any]) -> Policy:
    backend = cfg["policy"]["backend"]
    if backend == "tiny":
        from wamrl.policy.tiny import build_tiny

        return build_tiny(cfg)
    if backend == "fastwam":
        from wamrl.policy.fastwam import build_fastwam

        return build_fastwam(cfg)
    raise ValueError(f"policy.backend: unknown backend {backend!r}; known: {sorted(_backends())}")


def load_policy(directory: Path, device: str | torch.device = "cpu") -> Policy:
    """The policy a directory holds, after checking every file against the sha256 its
    checkpoint.json records (a flipped byte in tensor data would load without complaint)."""
    verify_checkpoint(directory)
    meta = read_policy_yaml(Path(directory) / "policy.yaml")
    backends = _backends()
    if meta["backend"] not in backends:
        raise ValueError(
            f"{directory}: unknown backend {meta['backend']!r}; known: {sorted(backends)}"
        )
    return backends[meta["backend"]].load(Path(directory), device=device)
