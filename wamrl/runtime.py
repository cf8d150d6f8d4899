"""Process-level choices every stage makes the same way: device, threads, GL backend."""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager
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


def pick_device(cfg: dict[str, Any]) -> torch.device:
    """cfg device cpu | cuda | auto. Snakemake sets no GPU: a job picks cuda:$WAMRL_GPU (default 0)."""
    want = cfg["device"]
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("config device is 'cuda' but torch sees no CUDA device")
        return torch.device(f"cuda:{int(os.environ.get('WAMRL_GPU', '0'))}")
    return torch.device("cpu")


def set_gl_backend(cfg: dict[str, Any]) -> None:
    """MuJoCo reads MUJOCO_GL at import: set it before anything imports robosuite."""
    os.environ.setdefault("MUJOCO_GL", cfg["env"]["mujoco_gl"])
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
