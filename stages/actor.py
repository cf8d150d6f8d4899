"""Actor stage: PPO over the kept macro-steps -> iter_n/actor/.

Inputs: the shards with reward/, iter_n/reward.done, iter_{n-1}/policy (and
iter_{n-1}/actor/optimizer.* if present, so Adam's moments carry across iterations;
iter_000/policy as the reference actor when actor.ref_kl > 0). Outputs, atomically:
actor.safetensors (the actor group's tensors, names as in policy.state_dict()),
optimizer.safetensors + optimizer.json, metrics.json (with the resolved config), and
master.safetensors (float32 master weights of the actor tensors stored in a lower precision,
e.g. bf16 on `fastwam`; absent when all are float32), and checkpoint.json (the sha256 of
every file, checked by merge and the next actor). The next iteration restores a master
when it rounds to exactly the merged checkpoint's weight, so updates smaller than a bf16
ulp keep accumulating across iterations instead of being cut off at each merge.

actor.devices = N > 1: N processes (wamrl.distributed: gloo on CPU; on CUDA nccl, a GPU
per rank from distributed.pick_devices) each load the inputs and run the same data-parallel
update (ppo.actor_update splits every minibatch over the ranks and all-reduces gradients
and statistics); rank 0 alone writes actor/ and the TensorBoard scalars.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from wamrl import distributed, paths, store, tb
from wamrl.artifact import (
    checkpoint_hashes,
    load_tensors,
    read_json,
    save_tensors,
    verify_checkpoint,
)
from wamrl.atomic import atomic_dir, write_json
from wamrl.config import ActorSection, RolloutSection, check_made_under, section
from wamrl.ppo import actor_update, load_actor_data, trust_region_scale
from wamrl.runtime import pick_device
from wamrl.training import (
    optimizer_from_tensors,
    optimizer_to_tensors,
    param_names,
    trainable_optimizer,
)


def main(cfg: dict[str, Any], run_dir: Path, iteration: int) -> None:
    n = section(cfg, ActorSection).devices
    if n > 1:
        devices = distributed.pick_devices(cfg, n, "actor")
        distributed.launch(_rank_main, devices, cfg, Path(run_dir), iteration)
    else:
        _run(cfg, Path(run_dir), iteration, pick_device(cfg, "actor"))


def _rank_main(
    rank: int, device: torch.device, cfg: dict[str, Any], run_dir: Path, iteration: int
) -> None:
    """One rank of actor.devices (inside wamrl.distributed.launch's process group)."""
    _run(cfg, run_dir, iteration, device, write=rank == 0)


def _run(
    cfg: dict[str, Any],
    run_dir: Path,
    iteration: int,
    device: torch.device | str,
    write: bool = True,
) -> None:
    from wamrl.policy import load_policy
    from wamrl.policy.text import load_contexts

    done_path = paths.reward_done(run_dir, iteration)
    done = read_json(done_path, "the reward stage's record")
    shards = paths.shard_paths(run_dir, iteration, section(cfg, RolloutSection).workers)
    # Before any work: the rollouts and their rewards were made under this run's settings.
    check_made_under(cfg, done.get("config"), "reward", done_path)
    store.check_made_under(shards, cfg, with_reward=True)
    prev_dir = paths.policy_dir(run_dir, iteration - 1)
    policy = load_policy(prev_dir, device=device)
    context, mask = load_contexts(prev_dir / paths.CONTEXT_FILE)
    data = load_actor_data(
        shards, context, mask, cfg, done.get("groups_kept", 0), done.get("groups_total", 0)
    )

    acfg = section(cfg, ActorSection)
    ref = load_policy(paths.policy_dir(run_dir, 0), device=device) if acfg.ref_kl != 0 else None
    # the video expert is frozen; Adam's state carries over from iteration n-1 (below)
    params, opt = trainable_optimizer(policy, "actor", acfg.lr, acfg.beta1)
    names = param_names(policy, params)
    restored = masters_restored = 0
    prev_actor = paths.actor_dir(run_dir, iteration - 1)
    if prev_actor.is_dir():
        verify_checkpoint(prev_actor)  # Adam's state and masters as they were written
    prev_opt = prev_actor / paths.OPTIMIZER_FILE
    if prev_opt.exists():
        restored = optimizer_from_tensors(opt.inner, names, load_tensors(prev_opt, "Adam state"))
    if opt.num_masters and (prev_actor / paths.MASTER_FILE).exists():
        masters_restored = opt.load_masters(
            names, load_tensors(prev_actor / paths.MASTER_FILE, "master weights")
        )

    # actor.anneal: the trust region shrinks over the run's pipeline.iterations
    scale = trust_region_scale(acfg.anneal, iteration, int(cfg["pipeline"]["iterations"]))
    seed = int(cfg["seed"]) * 1000 + iteration
    metrics = actor_update(policy, ref, data, cfg, opt, device=device, seed=seed, kl_scale=scale)
    metrics["optimizer_state_restored_params"] = restored
    # Adam's moments carry over from iteration n-1's actor/ (not a declared input: the DAG
    # must not wait on it). Without it Adam starts from zero: said here, not silent.
    metrics["optimizer_reset"] = iteration > 1 and restored == 0
    metrics["optimizer_state_from"] = str(prev_opt) if restored else None
    if metrics["optimizer_reset"]:
        print(
            f"optimizer_reset: no Adam state in {prev_opt}: "
            "Adam's moments start from zero this iteration"
        )
    metrics["master_weights_params"] = opt.num_masters
    metrics["master_weights_restored_params"] = masters_restored
    metrics["devices"] = distributed.world_size()
    if not write:
        return

    state = policy.state_dict()
    actor_tensors = {n: state[n].detach().cpu().contiguous() for n in names}
    opt_tensors, opt_meta = optimizer_to_tensors(opt.inner, names)  # keyed as before: "Adam"
    masters = opt.master_tensors(names)
    with atomic_dir(paths.actor_dir(run_dir, iteration)) as tmp:
        save_tensors(actor_tensors, tmp / paths.ACTOR_FILE)
        save_tensors(opt_tensors, tmp / paths.OPTIMIZER_FILE)
        write_json(tmp / paths.OPTIMIZER_JSON, opt_meta)
        if masters:
            save_tensors(masters, tmp / paths.MASTER_FILE)
        write_json(tmp / paths.METRICS_FILE, {"iteration": iteration, **metrics, "config": cfg})
        # merge and the next actor check these before reading a tensor
        write_json(tmp / paths.CHECKPOINT_FILE, {**checkpoint_hashes(tmp), "iteration": iteration})
    tb.log_scalars(run_dir, "actor", iteration, lambda: tb.actor_scalars(metrics))
