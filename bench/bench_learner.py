"""Learner throughput: PPO actor update macro-steps/s and model FLOP utilisation (not a test).

    python bench/bench_learner.py                                   # tiny, CPU
    python bench/bench_learner.py --device cuda --steps 2048 --minibatch 256
    python bench/bench_learner.py --device cuda --config configs/fullsize.yaml --steps 256 \
        --minibatch 32

A macro-step is one stored query (image, proprio, x_k*, x_k*+1, log pi_old, advantage).
The update is wamrl.ppo.actor_update as the actor stage runs it: the log pi check over all
steps, then actor.epochs epochs of minibatches (prefill under no_grad, the action expert's
step with gradients, fp32 log-probs). Data are random but self-consistent (x_k*+1 is the
policy's own SDE step from a random x_k*, log pi_old its own log pi), so the check passes.
FLOPs are counted once per minibatch with torch's FlopCounterMode (forward + backward);
utilisation is against --peak-tflops (H200 dense bf16: 989). Each precision (--amp fp32 bf16, i.e. actor.amp) starts from the same weights;
the last column is how far its log pi lies from float32's on the first minibatch.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch.utils.flop_counter import FlopCounterMode

from wamrl.config import load_config
from wamrl.policy import build_policy
from wamrl.ppo import AMP_DTYPES, ActorData, _log_prob, actor_update
from wamrl.sampler import sde_mean_std, sigma_schedule


def refresh_logp_old(policy, data: ActorData, batch: int, device) -> None:
    """log pi_old := the policy's own log pi (what a rollout with these weights stored)."""
    with torch.no_grad():
        for s in range(0, len(data), batch):
            idx = np.arange(s, min(s + batch, len(data)))
            data.logp_old[idx] = _log_prob(policy, data, idx, device).float().cpu().numpy()


def synthetic_data(policy, n: int, K: int, a: float, shift: float, batch: int, device) -> ActorData:
    rng = np.random.default_rng(0)
    L, D = 24, policy.cfg.text_dim
    data = ActorData(
        image=rng.integers(0, 256, (n, 224, 448, 3), dtype=np.uint8),
        proprio=rng.uniform(-1, 1, (n, 8)).astype(np.float32),
        task=rng.integers(0, 40, n),
        x_k=rng.normal(size=(n, 32, 7)).astype(np.float32),
        x_next=rng.normal(size=(n, 32, 7)).astype(np.float32) * 0.5,
        k_star=rng.integers(1, K, n),
        logp_old=np.zeros(n, np.float32),
        adv=rng.normal(size=n).astype(np.float32),
        where=np.zeros((n, 3), np.int64),
        context=torch.randn(40, L, D),
        context_mask=torch.ones(40, L, dtype=torch.bool),
        K=K,
        noise_a=a,
        shift=shift,
    )
    sample_x_next(policy, data, batch, device, rng)
    refresh_logp_old(policy, data, batch, device)
    return data


def sample_x_next(policy, data: ActorData, batch: int, device, rng: np.random.Generator) -> None:
    """x_{k*+1} := the policy's own SDE step from x_{k*}, as a rollout stores it (so that
    (x_{k*+1} - mu) / std ~ N(0, 1): the log pi differences then mean what they would in PPO)."""
    sigmas = sigma_schedule(data.K, data.shift)
    with torch.no_grad():
        for s in range(0, len(data), batch):
            idx = np.arange(s, min(s + batch, len(data)))
            obs = data.obs(idx, device)
            x_k = data.tensor("x_k", idx, device)
            k = torch.from_numpy(data.k_star[idx])
            s_k, s_next = sigmas[k].to(device), sigmas[k + 1].to(device)
            v = policy.velocity(policy.prefill(obs), x_k, s_k)
            mu, std = sde_mean_std(x_k, v, s_k, s_next, data.noise_a)
            xi = torch.from_numpy(rng.normal(size=tuple(mu.shape)).astype(np.float32)).to(device)
            data.x_next[idx] = (mu + std * xi).cpu().numpy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--config", nargs="*", default=[])
    p.add_argument("--steps", type=int, default=128, help="macro-steps in the update")
    p.add_argument("--minibatch", type=int, default=None, help="default actor.minibatch")
    p.add_argument("--epochs", type=int, default=None, help="default actor.epochs")
    p.add_argument("--micro-batch", type=int, default=None, help="actor.micro_batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--amp", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    over = {}
    if args.minibatch:
        over["actor.minibatch"] = args.minibatch
    if args.epochs is not None:
        over["actor.epochs"] = args.epochs
    if args.micro_batch is not None:
        over["actor.micro_batch"] = args.micro_batch
    cfg = load_config(args.config, over)
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:  # full-size weights are made on the GPU, not copied there
        policy = build_policy(cfg)
    s = cfg["sampler"]
    mb, epochs = cfg["actor"]["minibatch"] or args.steps, cfg["actor"]["epochs"]
    data = synthetic_data(policy, args.steps, s["K"], s["noise_a"], s["shift"], mb, device)
    initial = {k: v.clone() for k, v in policy.state_dict().items()}

    # FLOPs of one minibatch (prefill no_grad + action step fwd/bwd), counted once.
    idx = np.arange(min(mb, len(data)))
    with FlopCounterMode(display=False) as fc:
        _log_prob(policy, data, idx, device).sum().backward()
    policy.zero_grad(set_to_none=True)
    flops_mb = fc.get_total_flops() / len(idx)  # per macro-step, one pass
    with torch.no_grad():
        ref = _log_prob(policy, data, idx, device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    n_params = sum(q.numel() for q in policy.parameters()) / 1e6
    table = Table(title=f"PPO actor update, {device}, {n_params:.1f} M params")
    cols = ("precision", "macro-steps", "minibatch", "micro-batch", "epochs", "wall s",
            "macro-steps/s", "TFLOP/s", "MFU", "peak memory", "max |log pi - fp32|")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right")
    for amp in args.amp:
        policy.load_state_dict(initial)
        refresh_logp_old(policy, data, mb, device)
        # bf16 cannot reproduce the stored fp32 log pi_old: the learner recomputes its own.
        acfg = {**cfg["actor"], "amp": None if amp == "fp32" else amp,
                "logp_old": "rollout" if amp == "fp32" else "recompute"}  # fmt: skip
        with torch.no_grad():
            dev = (_log_prob(policy, data, idx, device, AMP_DTYPES[acfg["amp"]]) - ref).abs().max()
        opt = torch.optim.Adam(policy.parameter_groups()["actor"], lr=cfg["actor"]["lr"])
        actor_update(policy, None, data, {**cfg, "actor": {**acfg, "epochs": 1}}, opt, device)
        refresh_logp_old(policy, data, mb, device)  # the warm-up changed the weights
        sync()  # warm-up (allocator, kernels)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        metrics = actor_update(policy, None, data, {**cfg, "actor": acfg}, opt, device)
        sync()
        wall = time.perf_counter() - t0
        n_pass = len(data) * epochs  # updates; the log pi check adds a forward-only pass
        tf = flops_mb * n_pass / wall / 1e12  # the check's forward is not counted
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        table.add_row(
            amp, str(len(data)), str(mb), str(acfg["micro_batch"] or mb), str(epochs),
            f"{wall:.2f}", f"{n_pass / wall:.1f}", f"{tf:.2f}", f"{tf / args.peak_tflops:.1%}",
            "-" if peak is None else f"{peak:.1f} GiB", f"{float(dev):.2e}",
        )  # fmt: skip
        print(f"{amp} logp check:", metrics["logp_check"])
    Console().print(table)


if __name__ == "__main__":
    main()
