"""World-model stage: LoRA update of the video expert -> iter_n/world_model/.

Inputs: the shards' successful video-SFT episodes, iter_{n-1}/policy (trained),
iter_000/policy (frozen reference for the feature KL), and iter_{n-1}/world_model/
sigma_ref + ema if an earlier iteration estimated them. Outputs, atomically:
lora.safetensors (names as in policy.state_dict()), sigma_ref.safetensors,
ema.safetensors, metrics.json (with the resolved config), checkpoint.json (the sha256 of
every file, checked by merge and the next iteration). With no usable window the
LoRA is written unchanged and metrics say why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from wamrl import paths, store, tb
from wamrl.artifact import checkpoint_hashes, load_tensors, save_tensors, verify_checkpoint
from wamrl.atomic import atomic_dir, write_json
from wamrl.config import EnvSection, RolloutSection, WorldModelSection, section
from wamrl.envs.conventions import Normalizer
from wamrl.runtime import pick_device
from wamrl.training import param_names
from wamrl.world_model import WindowBatches, list_windows, world_model_update


def _load_vector(path: Path, key: str) -> torch.Tensor | None:
    """A carried Sigma vector, or None if absent (or written empty: never estimated)."""
    if not path.exists():
        return None
    return load_tensors(path, "a carried Sigma estimate").get(key)


def _save_vector(path: Path, key: str, v: torch.Tensor | None) -> None:
    tensors = {} if v is None else {key: v.detach().cpu().float().contiguous()}
    save_tensors(
        tensors, path, metadata={"status": "estimated" if v is not None else "not_estimated"}
    )


def main(cfg: dict[str, Any], run_dir: Path, iteration: int) -> None:
    from wamrl.policy import load_policy
    from wamrl.policy.text import load_contexts

    run_dir = Path(run_dir)
    shards = paths.shard_paths(run_dir, iteration, section(cfg, RolloutSection).workers)
    store.check_made_under(shards, cfg)  # before any work: rolled out under these settings
    device = pick_device(cfg, "world_model")
    wcfg = cfg["world_model"]
    prev_dir = paths.policy_dir(run_dir, iteration - 1)
    policy = load_policy(prev_dir, device=device)
    frozen = load_policy(paths.policy_dir(run_dir, 0), device=device)
    for p in frozen.parameters():
        p.requires_grad_(False)
    context, mask = load_contexts(prev_dir / paths.CONTEXT_FILE)
    # The rollout normalised its queries with this policy's stats: the same for video/proprio.
    normalizer = Normalizer.load(prev_dir / paths.STATS_FILE)
    specs, counts = list_windows(shards, wcfg)
    batches = WindowBatches(
        shards,
        specs,
        section(cfg, WorldModelSection).batch,
        context,
        mask,
        wcfg,
        section(cfg, EnvSection).replan_steps,
        device,
        normalizer,
    )

    prev_wm = paths.world_model_dir(run_dir, iteration - 1)
    if prev_wm.is_dir():
        verify_checkpoint(prev_wm)  # the carried Sigma estimates as they were written
    sigma_ref = _load_vector(prev_wm / paths.SIGMA_REF_FILE, "sigma_ref")
    sigma_theta = _load_vector(prev_wm / paths.EMA_FILE, "sigma_theta")
    metrics, sigma_ref, sigma_theta = world_model_update(
        policy,
        frozen,
        batches,
        cfg,
        sigma_ref,
        sigma_theta,
        seed=int(cfg["seed"]) * 1000 + iteration,
    )
    metrics.update(counts)

    lora = policy.parameter_groups()["world_model"]
    state = policy.state_dict()
    lora_tensors = {n: state[n].detach().cpu().contiguous() for n in param_names(policy, lora)}
    with atomic_dir(paths.world_model_dir(run_dir, iteration)) as tmp:
        save_tensors(lora_tensors, tmp / paths.LORA_FILE)
        _save_vector(tmp / paths.SIGMA_REF_FILE, "sigma_ref", sigma_ref)
        _save_vector(tmp / paths.EMA_FILE, "sigma_theta", sigma_theta)
        write_json(tmp / paths.METRICS_FILE, {"iteration": iteration, **metrics, "config": cfg})
        # merge and the next iteration check these before reading a tensor
        write_json(tmp / paths.CHECKPOINT_FILE, {**checkpoint_hashes(tmp), "iteration": iteration})
    tb.log_scalars(run_dir, "world_model", iteration, lambda: tb.world_model_scalars(metrics))
