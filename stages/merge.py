"""Merge stage: iter_{n-1}/policy with the new actor and LoRA tensors -> iter_n/policy/.

Every tensor in actor.safetensors and lora.safetensors must exist in the policy's
state_dict with the same shape (a mismatch names it); nothing else changes.
context.safetensors and stats.json are copied; checkpoint.json records the sha256 of
model.safetensors, the iteration and the parents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wamrl import paths
from wamrl.artifact import load_tensors, verify_checkpoint
from wamrl.atomic import sha256_file
from wamrl.policy.checkpoint import write_policy_dir
from wamrl.runtime import say_device


def main(cfg: dict[str, Any], run_dir: Path, iteration: int) -> None:
    from wamrl.policy import load_policy

    run_dir = Path(run_dir)
    prev_dir = paths.policy_dir(run_dir, iteration - 1)
    actor_file = paths.actor_dir(run_dir, iteration) / paths.ACTOR_FILE
    lora_file = paths.world_model_dir(run_dir, iteration) / paths.LORA_FILE
    for f in (actor_file, lora_file):  # a changed tensor would be merged into the new policy
        verify_checkpoint(f.parent)
    # Copying tensors by name needs no accelerator, and merge holds no GPU slot.
    say_device("merge", "device cpu", "merging tensors needs no GPU")
    policy = load_policy(prev_dir, device="cpu")
    state = policy.state_dict()
    new: dict[str, Any] = {}
    for f in (actor_file, lora_file):
        for name, t in load_tensors(f).items():
            if name not in state:
                raise KeyError(f"{f}: tensor {name!r} is not in the policy's state_dict")
            if tuple(state[name].shape) != tuple(t.shape):
                raise ValueError(
                    f"{f}: {name} has shape {tuple(t.shape)}, policy has {tuple(state[name].shape)}"
                )
            if name in new:
                raise ValueError(f"{name} is in both the actor and the world-model output")
            new[name] = t
    result = policy.load_state_dict(new, strict=False)
    if result.unexpected_keys:
        raise KeyError(f"unexpected keys while merging: {result.unexpected_keys}")

    def parent(p: Path) -> dict[str, str]:
        return {"path": str(p.relative_to(run_dir)), "sha256": sha256_file(p)}

    write_policy_dir(
        paths.policy_dir(run_dir, iteration),
        policy,
        prev_dir / paths.CONTEXT_FILE,
        prev_dir / paths.STATS_FILE,
        {
            "iteration": iteration,
            "parents": {
                "policy": parent(prev_dir / paths.MODEL_FILE),
                "actor": parent(actor_file),
                "world_model": parent(lora_file),
            },
            "replaced_tensors": len(new),
            "config": cfg,
        },
    )
