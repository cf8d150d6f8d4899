"""Data-parallel learner processes (actor.devices > 1): init, teardown and a launcher.

`launch(fn, devices, *args)` runs fn(rank, devices[rank], *args) in len(devices) processes
spawned by torch.multiprocessing (MASTER_ADDR 127.0.0.1, a free port), each with a process
group initialised: gloo on CPU, nccl on CUDA. `pick_devices(cfg, n)` chooses them: n times
the CPU, or n distinct GPUs among those CUDA_VISIBLE_DEVICES shows (cuda:g..g+n-1 with
$WAMRL_GPU = g set, else n GPU slot locks of runtime.acquire_gpu_slot, held by the
launching process, so that concurrent one-GPU jobs keep off them).

ppo.actor_update sees the group (world_size() > 1) and splits every minibatch over the
ranks, all-reducing gradients and statistics, so every rank takes the same optimizer step;
without a group everything here is a no-op (world size 1).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# Held for the launching process's life: the GPU slot locks its ranks' GPUs (pick_devices).
_SLOT_LOCKS: list[Any] = []


def pick_devices(cfg: dict[str, Any], n: int, stage: str = "actor") -> list[torch.device]:
    """The devices of n ranks (cfg device cpu | cuda | auto), said on stderr."""
    from wamrl import runtime

    want = cfg["device"]
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want != "cuda":
        devices, why = [torch.device("cpu")] * n, f"config device {cfg['device']}"
    elif not torch.cuda.is_available():
        raise RuntimeError("config device is 'cuda' but torch sees no CUDA device")
    elif torch.cuda.device_count() < n + int(os.environ.get("WAMRL_GPU", 0)):
        raise RuntimeError(
            f"{n} learner devices asked for (from WAMRL_GPU = "
            f"{os.environ.get('WAMRL_GPU', 0)}) but torch sees {torch.cuda.device_count()} "
            "CUDA device(s) (CUDA_VISIBLE_DEVICES)"
        )
    elif "WAMRL_GPU" in os.environ:
        first = int(os.environ["WAMRL_GPU"])
        devices = [torch.device(f"cuda:{first + r}") for r in range(n)]
        why = "WAMRL_GPU"
    else:
        while len(_SLOT_LOCKS) < n:  # one whole GPU per rank: its first slot
            _SLOT_LOCKS.append(
                runtime.acquire_gpu_slot(torch.cuda.device_count(), runtime.gpu_slot_dir())
            )
        devices = [torch.device(f"cuda:{i}") for i, _ in _SLOT_LOCKS[:n]]
        why = "slot locks " + ", ".join(f.name for _, f in _SLOT_LOCKS[:n])
    runtime.say_device(stage, f"{n} ranks on {', '.join(map(str, devices))}", why)
    return devices


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init(r: int, world: int, device: torch.device | str) -> None:
    """Join the process group as rank r of `world` on `device` (gloo on CPU, nccl on CUDA;
    MASTER_ADDR/PORT from the environment)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), rank=r, world_size=world)


def teardown() -> None:
    if is_initialized():
        dist.destroy_process_group()


def _entry(
    r: int, fn: Callable[..., Any], devices: list[str], args: tuple, parent_pid: int
) -> None:
    from wamrl.lifetime import die_with_parent

    die_with_parent(parent_pid)  # a rank must not outlive a killed stage
    device = torch.device(devices[r])
    if device.type == "cpu":
        # n processes share the box's cores: do not oversubscribe them n-fold.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(devices)))
    init(r, len(devices), device)
    try:
        fn(r, device, *args)
    finally:
        teardown()


def launch(fn: Callable[..., Any], devices: list[torch.device], *args: Any) -> None:
    """Run fn(rank, devices[rank], *args) in len(devices) spawned processes, each in the
    process group; re-raises a rank's failure (torch.multiprocessing.spawn then stops the
    other ranks). fn must be importable (a module-level function) and args picklable."""
    import torch.multiprocessing as mp

    kinds = {torch.device(d).type for d in devices}
    if len(kinds) != 1:
        raise ValueError(f"ranks on mixed device types {sorted(kinds)}")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    names = [str(d) for d in devices]
    mp.spawn(_entry, args=(fn, names, args, os.getpid()), nprocs=len(devices), join=True)


# ---- collectives used by ppo.actor_update ---------------------------------------------------


def all_reduce_sum(values: list[float], device: torch.device | str) -> list[float]:
    """Sum a list of floats over the ranks (float64; identical result on every rank)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.cpu()]


def all_reduce_arrays(arrays: list[np.ndarray], device: torch.device | str) -> list[np.ndarray]:
    """Sum host arrays over the ranks (through `device`: nccl reduces CUDA tensors only)."""
    out = []
    for a in arrays:
        t = torch.from_numpy(np.ascontiguousarray(a)).to(device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        out.append(t.cpu().numpy())
    return out


@torch.no_grad()
def all_reduce_grads(params: list[torch.nn.Parameter], device: torch.device | str) -> None:
    """Sum every parameter's gradient over the ranks, in float32 for lower-precision grads.

    A parameter that got no gradient on some rank (an empty share of a small minibatch)
    takes zeros there; one that got none on any rank keeps grad None, as in one process.
    """
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.SUM)
    pending = []
    for p, h in zip(params, has.tolist(), strict=True):
        if h == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buf = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
        pending.append((p, buf, dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True)))
    for p, buf, work in pending:
        work.wait()
        if buf is not p.grad:
            p.grad.copy_(buf)
