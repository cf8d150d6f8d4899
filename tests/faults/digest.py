"""What a run computed, as digests comparable across run directories (the fault matrix
compares a faulted-then-resumed run with a clean one)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import zarr

from wamrl import paths
from wamrl.store import _array_paths

# Files whose whole bytes are the result (safetensors hold no paths or times).
TENSOR_FILES = {
    "actor": ("actor.safetensors", "optimizer.safetensors"),
    "world_model": ("lora.safetensors", "sigma_ref.safetensors", "ema.safetensors"),
    "policy": ("model.safetensors",),
}
# JSON keys that record where or when, not what.
VOLATILE = {"wall_time_s", "first_query_s", "config", "path", "shards", "time_s", "seconds"}


def _json(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: _json(v) for k, v in obj.items() if k not in VOLATILE and "time" not in k}
    if isinstance(obj, list):
        return [_json(v) for v in obj]
    return obj


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


def digest(run: Path, iteration: int, workers: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for w, shard in enumerate(paths.shard_paths(run, iteration, workers)):
        g = zarr.open_group(str(shard), mode="r")
        for p in sorted(_array_paths(g)):
            out[f"shard_{w}/{p}"] = _sha(np.ascontiguousarray(g[p][:]).tobytes())
    for d, files in TENSOR_FILES.items():
        for f in files:
            path = paths.iter_dir(run, iteration) / d / f
            if path.exists():
                out[f"{d}/{f}"] = _sha(path.read_bytes())
    for name in ("reward.done", "eval.json", "actor/metrics.json", "world_model/metrics.json"):
        path = paths.iter_dir(run, iteration) / name
        if not path.exists():
            out[name] = "missing"
            continue
        out[name] = _sha(json.dumps(_json(json.loads(path.read_text())), sort_keys=True).encode())
    return out


def differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
