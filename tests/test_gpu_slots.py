"""One GPU per job: slot locks give concurrent jobs distinct GPUs (runtime.acquire_gpu_slot)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from wamrl import runtime


def _hold(lock_dir: str, count: int, per_gpu: int, out: mp.Queue, release: str) -> None:
    index, _lock = runtime.acquire_gpu_slot(count, Path(lock_dir), per_gpu, poll_s=0.05)
    out.put((os.getpid(), index))
    # A file, not an Event: a waiter killed with -9 would leave an Event's condition blocked.
    deadline = time.monotonic() + 30
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _start(ctx, lock_dir: Path, count: int, per_gpu: int, out, release):
    p = ctx.Process(target=_hold, args=(str(lock_dir / "locks"), count, per_gpu, out, release))
    p.start()
    return p


def test_four_jobs_take_four_gpus_and_a_fifth_waits(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out, release = ctx.Queue(), str(tmp_path / "release")
    jobs = [_start(ctx, tmp_path, 4, 1, out, release) for _ in range(4)]
    got = dict(out.get(timeout=60) for _ in jobs)
    assert sorted(got.values()) == [0, 1, 2, 3]  # distinct GPUs
    fifth = _start(ctx, tmp_path, 4, 1, out, release)
    time.sleep(1.0)
    assert out.empty()  # every GPU is held: the fifth job waits
    # kill -9 the job on GPU 2: the kernel drops its lock and the waiting job takes GPU 2.
    victim = next(pid for pid, i in got.items() if i == 2)
    os.kill(victim, signal.SIGKILL)
    pid, index = out.get(timeout=30)
    assert pid == fifth.pid and index == 2
    Path(release).touch()
    for p in [*jobs, fifth]:
        p.join(30)


def test_jobs_per_gpu_fills_every_gpu_before_sharing(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out, release = ctx.Queue(), str(tmp_path / "release")
    jobs = []
    seen = []
    for _ in range(4):  # one at a time, so the order of slots is the order of arrival
        jobs.append(_start(ctx, tmp_path, 2, 2, out, release))
        seen.append(out.get(timeout=60)[1])
    assert seen == [0, 1, 0, 1]
    Path(release).touch()
    for p in jobs:
        p.join(30)


def test_pick_device_on_cpu_says_so(capsys) -> None:
    assert runtime.pick_device({"device": "cpu"}, "actor") == torch.device("cpu")
    assert "wamrl actor: device cpu" in capsys.readouterr().err


def test_pick_device_honours_wamrl_gpu(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WAMRL_GPU", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert runtime.pick_device({"device": "cuda"}, "reward") == torch.device("cuda:3")
    err = capsys.readouterr().err
    assert "device cuda:3 (WAMRL_GPU; CUDA_VISIBLE_DEVICES=4,5,6,7)" in err


def test_pick_device_takes_a_slot_among_the_visible_gpus(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("WAMRL_GPU", raising=False)
    monkeypatch.setattr(runtime, "gpu_slot_dir", lambda: tmp_path)
    monkeypatch.setattr(runtime, "_SLOT_LOCK", None)
    held = runtime.acquire_gpu_slot(2, tmp_path)  # another job holds GPU 0
    assert held[0] == 0
    assert runtime.pick_device({"device": "cuda"}, "eval") == torch.device("cuda:1")
    assert runtime.pick_device({"device": "cuda"}, "eval") == torch.device("cuda:1")  # kept
    held[1].close()


@pytest.mark.parametrize("device", ["cuda"])
def test_pick_device_cuda_without_a_gpu_fails_clearly(monkeypatch, device) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        runtime.pick_device({"device": device})


def test_pick_device_under_slurm_takes_the_assigned_gpu_without_a_lock(
    monkeypatch, tmp_path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("WAMRL_GPU", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(runtime, "gpu_slot_dir", lambda: tmp_path)
    assert runtime.pick_device({"device": "cuda"}, "rollout") == torch.device("cuda:0")
    assert not list(tmp_path.iterdir())  # no lock taken
