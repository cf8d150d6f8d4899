"""`wamrl verify RUN_DIR`: check every artifact of a run without running a stage.

    episode stores   iter_*/rollouts/shard_*.zarr   store.validate_store: contract, masks,
                                                    every chunk file's crc32c
    demo stores      demos/shard_*.zarr             every chunk file's crc32c
    checkpoints      iter_*/policy, sft/policy      artifact.verify_checkpoint: the sha256
                                                    that checkpoint.json records, per file
    JSON             *.json, reward.done            artifact.read_json: parses
    safetensors      actor/, world_model/, ...      artifact.tensor_header: the header reads

A finished run passes; a flipped byte, a truncated file or a damaged header is named.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from wamrl.artifact import ArtifactError, read_json, tensor_header, verify_checkpoint

# Not artifacts: Snakemake's and TensorBoard's own files, logs, the report's output.
_SKIP_DIRS = {".snakemake", "logs", "tb", "report", "context"}


def _files(run_dir: Path) -> Iterator[Path]:
    """Every file under run_dir outside stores, hidden temp dirs and _SKIP_DIRS."""
    for p in sorted(run_dir.iterdir()):
        if p.name.startswith(".") or p.name in _SKIP_DIRS or p.suffix == ".zarr":
            continue
        if p.is_dir():
            yield from _files(p)
        elif p.is_file():
            yield p


def verify_run(run_dir: str | Path, deep: bool = False) -> list[tuple[str, str | None]]:
    """(artifact, None if intact else the problem) for every artifact of the run.
    deep: also decompress every chunk of the episode stores."""
    from wamrl.store_check import checksum_problems, validate_store

    run_dir = Path(run_dir)
    out: list[tuple[str, str | None]] = []

    def rel(p: Path) -> str:
        return str(p.relative_to(run_dir))

    for shard in sorted(run_dir.glob("iter_*/rollouts/shard_*.zarr")):
        problems = validate_store(shard, deep=deep)
        out.append((rel(shard), "; ".join(problems) or None))
    for shard in sorted(run_dir.glob("demos/shard_*.zarr")):
        problems = checksum_problems(shard)
        out.append((rel(shard), "; ".join(problems) or None))
    for ck in sorted(run_dir.glob("**/checkpoint.json")):
        if any(
            part.startswith(".") or part in _SKIP_DIRS for part in ck.relative_to(run_dir).parts
        ):
            continue
        try:
            verify_checkpoint(ck.parent)
            out.append((f"{rel(ck.parent)} (sha256 of its files)", None))
        except ArtifactError as e:
            out.append((f"{rel(ck.parent)} (sha256 of its files)", str(e)))
    for f in _files(run_dir):
        try:
            if f.suffix == ".json" or f.name == "reward.done":
                read_json(f)
            elif f.suffix == ".safetensors":
                tensor_header(f)
            else:
                continue
            out.append((rel(f), None))
        except ArtifactError as e:
            out.append((rel(f), str(e)))
    return out
