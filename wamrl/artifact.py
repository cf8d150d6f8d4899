"""Reading and writing the run's JSON and safetensors artifacts, in one place.

Every JSON artifact (stats.json, eval.json, reward.done, checkpoint.json, metrics.json, ...)
is read with `read_json`, every safetensors file with `load_tensors` / `tensor_header`: a
missing, truncated or damaged file raises ArtifactError naming it (never a bare
JSONDecodeError or SafetensorError). A policy directory's checkpoint.json records the sha256
of its files (`checkpoint_hashes`); `verify_checkpoint` checks them before a load, since a
flipped byte in tensor data leaves a safetensors file perfectly loadable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wamrl.atomic import sha256_file

_UMASK = os.umask(0)
os.umask(_UMASK)


class ArtifactError(ValueError):
    """A missing, unreadable or damaged artifact; the message names the file."""


class MissingArtifact(ArtifactError, FileNotFoundError):
    """The artifact does not exist (also a FileNotFoundError)."""


def _label(path: Path, what: str) -> str:
    return f"{path} ({what})" if what else str(path)


def read_json(path: str | Path, what: str = "", keys: Sequence[str] = ()) -> Any:
    """The parsed JSON at `path`. what: the artifact's role, for the message ("reward.done
    of iteration 3"); keys: top-level keys it must have (then it must be an object)."""
    path = Path(path)
    label = _label(path, what)
    if not path.is_file():
        raise MissingArtifact(f"{label}: not found")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(
            f"{label}: not readable JSON ({type(e).__name__}: {e}); the file is damaged: "
            "rerun the stage that writes it"
        ) from e
    if keys:
        if not isinstance(doc, dict):
            raise ArtifactError(f"{label}: expected a JSON object, got {type(doc).__name__}")
        missing = [k for k in keys if k not in doc]
        if missing:
            raise ArtifactError(f"{label}: lacks key(s) {missing}")
    return doc


def load_tensors(path: str | Path, what: str = "") -> dict[str, Any]:
    """Every tensor of a safetensors file (torch, on the CPU)."""
    from safetensors.torch import load_file

    path = Path(path)
    label = _label(path, what)
    if not path.is_file():
        raise MissingArtifact(f"{label}: not found")
    try:
        return load_file(str(path))
    except Exception as e:  # SafetensorError (damaged header), OSError, ...
        raise ArtifactError(
            f"{label}: not a readable safetensors file ({type(e).__name__}: {e})"
        ) from e


def tensor_header(path: str | Path, what: str = "") -> tuple[dict[str, tuple[int, ...]], dict]:
    """({name: shape}, metadata) from a safetensors header, without reading tensor data."""
    from safetensors import safe_open

    path = Path(path)
    label = _label(path, what)
    if not path.is_file():
        raise MissingArtifact(f"{label}: not found")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
            return shapes, dict(f.metadata() or {})
    except Exception as e:
        raise ArtifactError(
            f"{label}: not a readable safetensors file ({type(e).__name__}: {e})"
        ) from e


def save_tensors(
    tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """safetensors' save_file, readable by the group like every other artifact: the library
    creates its files 0600, which other users of a shared run directory cannot read."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_UMASK)


CHECKPOINT = "checkpoint.json"


def checkpoint_hashes(directory: str | Path) -> dict[str, Any]:
    """What a policy directory's checkpoint.json records of its files: "sha256" (of
    model.safetensors, the key eval.json and the stores quote) and "files" (every other
    file's sha256). Call it last, when the directory holds everything but checkpoint.json."""
    directory = Path(directory)
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != CHECKPOINT)
    return {
        "sha256": sha256_file(directory / "model.safetensors"),
        "files": {n: sha256_file(directory / n) for n in files if n != "model.safetensors"},
    }


def verify_checkpoint(directory: str | Path) -> None:
    """Check every file whose sha256 the directory's checkpoint.json records; raise
    ArtifactError naming the first that differs. A directory without checkpoint.json (a
    user's own base policy) has nothing recorded to check."""
    directory = Path(directory)
    if not (directory / CHECKPOINT).is_file():
        return
    record = read_json(directory / CHECKPOINT, "the checkpoint's record")
    if not isinstance(record, dict):
        raise ArtifactError(f"{directory / CHECKPOINT}: expected a JSON object")
    want = dict(record.get("files") or {})
    if record.get("sha256"):
        want["model.safetensors"] = record["sha256"]
    for name, sha in sorted(want.items()):
        f = directory / name
        if not f.is_file():
            raise MissingArtifact(f"{f}: recorded in {CHECKPOINT} but missing")
        got = sha256_file(f)
        if got != sha:
            raise ArtifactError(
                f"{f}: sha256 {got} differs from the {sha} that {CHECKPOINT} records: the file "
                "changed after it was written (corrupted or replaced); restore it or rerun "
                "the stage that made this checkpoint"
            )


def checkpoint_sha256(policy_dir: str | Path) -> str:
    """The checkpoint's recorded sha256, else the hash of its model.safetensors."""
    ck = Path(policy_dir) / CHECKPOINT
    if ck.is_file():
        sha = read_json(ck, "the checkpoint's record").get("sha256")
        if sha:
            return str(sha)
    return sha256_file(Path(policy_dir) / "model.safetensors")
