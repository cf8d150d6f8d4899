"""Process-level choices every stage makes the same way: device, threads, GL backend."""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

# sampler.amp / actor.amp -> autocast dtype (null = float32 throughout)
AMP_DTYPES: dict[str | None, torch.dtype | None] = {None: None, "bf16": torch.bfloat16}


def autocast(device: torch.device | str, amp: torch.dtype | None) -> AbstractContextManager:
    """Autocast the model's matmuls to `amp` (None: a no-op). The weight-cast cache is off:
    a CUDA graph captured with it would replay casts whose memory autocast has freed, and
    the sampler math casts velocities back to float32 anyway (sampler.py)."""
    return torch.autocast(
        torch.device(device).type,
        dtype=amp or torch.bfloat16,
        enabled=amp is not None,
        cache_enabled=False,
    )


def wait_sleeping(device: torch.device | str, poll_s: float = 2e-4) -> None:
    """Wait until the work queued on `device`'s current stream is done, sleeping between
    checks. A plain CUDA synchronisation (`.cpu()`, `.item()`) spins a CPU core at full load
    until the GPU finishes; the policy process waits like that for most of a full-size
    rollout, on a core an env worker needs (and at a higher priority than the niced workers).
    Polling every 0.2 ms adds at most that to a query and uses almost no CPU. A no-op off CUDA.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    while not done.query():
        time.sleep(poll_s)


# Held for the process's life: the lock of the GPU slot this job took (pick_device).
_SLOT_LOCK: Any = None


def gpu_slot_dir() -> Path:
    """Node-local lock files, one per visible GPU: every wamrl job of this user on this
    machine (any run dir) competes for the same GPUs, so the locks live outside the run."""
    return Path(tempfile.gettempdir()) / f"wamrl-gpu-slots-{os.getuid()}"


def acquire_gpu_slot(
    count: int, lock_dir: Path, per_gpu: int = 1, poll_s: float = 1.0
) -> tuple[int, Any]:
    """A GPU of 0..count-1 with one of its `per_gpu` slots free: (index, the open lock file,
    to keep open while the GPU is used). Each GPU's first slot fills before any second one;
    waits while every slot is held.

    Snakemake caps concurrent `gpu=1` jobs at --resources gpu=N but names no device; the
    flock makes the N jobs take N different GPUs. The kernel drops a lock when its holder
    exits, also on kill -9, so a crashed job never keeps a GPU taken.
    """
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for j in range(per_gpu):
            for i in range(count):
                f = open(lock_dir / f"gpu{i}.{j}.lock", "a")  # noqa: SIM115 (kept open: the lock)
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.close()
                    continue
                return i, f
        time.sleep(poll_s)


def pick_device(cfg: dict[str, Any], stage: str = "stage") -> torch.device:
    """cfg device cpu | cuda | auto -> the device this job uses, said on stderr.

    On CUDA: $WAMRL_GPU if set; otherwise a GPU that fewer than cfg `jobs_per_gpu` (default
    1) concurrent wamrl jobs hold (a slot lock, acquire_gpu_slot), among those
    CUDA_VISIBLE_DEVICES shows. Under SLURM or Kubernetes the scheduler's
    CUDA_VISIBLE_DEVICES leaves the job its own GPUs, and the lock takes the first of them.
    """
    global _SLOT_LOCK
    want = cfg["device"]
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want != "cuda":
        device, why = torch.device("cpu"), f"config device {cfg['device']}"
    elif not torch.cuda.is_available():
        raise RuntimeError("config device is 'cuda' but torch sees no CUDA device")
    elif "WAMRL_GPU" in os.environ:
        device, why = torch.device(f"cuda:{int(os.environ['WAMRL_GPU'])}"), "WAMRL_GPU"
    elif "SLURM_JOB_ID" in os.environ or "KUBERNETES_SERVICE_HOST" in os.environ:
        # The scheduler gave this job its own GPUs (CUDA_VISIBLE_DEVICES); a node-local lock
        # keyed by the visible index would make two jobs on different GPUs wait for each other.
        device, why = torch.device("cuda:0"), "assigned by the scheduler"
    else:
        if _SLOT_LOCK is None:  # a second call in one process keeps its GPU
            per_gpu = int(cfg.get("jobs_per_gpu", 1))
            _SLOT_LOCK = acquire_gpu_slot(torch.cuda.device_count(), gpu_slot_dir(), per_gpu)
        index, lock = _SLOT_LOCK
        device, why = torch.device(f"cuda:{index}"), f"slot lock {lock.name}"
    say_device(stage, f"device {device}", why)
    return device


def say_device(stage: str, what: str, why: str) -> None:
    """The stage log's line on the device(s) a job took, and why (stderr)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    extra = f"; CUDA_VISIBLE_DEVICES={visible}" if visible is not None else ""
    print(f"wamrl {stage}: {what} ({why}{extra})", file=sys.stderr, flush=True)


def set_gl_backend(cfg: dict[str, Any]) -> None:
    """MuJoCo reads MUJOCO_GL at import: set it before anything imports robosuite."""
    os.environ.setdefault("MUJOCO_GL", cfg["env"]["mujoco_gl"])
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
