"""The fastwam backend's text contexts: each task's umT5 encoding, computed once per run.

Fast-WAM conditions on the umT5-xxl encoding of its prompt template filled with the task's
LIBERO instruction ("A video recorded from a robot's point of view executing the following
instruction: {task}"), tokenised to `policy.fastwam.context_len` (128) tokens. As in the
official `FastWAM.encode_prompt`, embeddings past the prompt's length are zeroed and the mask
is all True (the padding is visible, as in training).

Output: <run_dir>/context/context.safetensors in the layout of wamrl.policy.text.save_contexts
(tensors "context" [40, L, 4096] and "mask" [40, L], metadata "names", in task-table order) and
context/context.json (template, prompts, encoder files). The init stage stores this file as
iter_000/policy/context.safetensors, which merge copies forward, so rollout workers never load
the text encoder. `task_contexts` reuses an existing file when its task names, prompts and
encoder files match. `wamrl context` computes it ahead of init (stages/context.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from wamrl.artifact import read_json
from wamrl.atomic import atomic_dir
from wamrl.paths import CONTEXT_DIR, CONTEXT_FILE, CONTEXT_JSON
from wamrl.policy.fastwam import PROMPT_FALLBACK, check_file, config_from_run

Encoder = Callable[[list[str]], tuple[Tensor, Tensor]]


def prompt_template() -> str:
    """Fast-WAM's LIBERO prompt template (tests check it against the official source)."""
    return PROMPT_FALLBACK


def prompts_for(tasks: Sequence[Any]) -> list[str]:
    return [prompt_template().format(task=t.language) for t in tasks]


def official_encoder(cfg: dict[str, Any], device: str | torch.device = "cpu") -> Encoder:
    """The official umT5 encoder and tokenizer (files from policy.fastwam), as a function
    prompts -> (context [N, L, D], mask [N, L]) with FastWAM.encode_prompt's semantics."""
    fcfg = config_from_run(cfg)
    enc_path = check_file(fcfg.text_encoder, "text_encoder")
    tok_path = check_file(fcfg.tokenizer, "tokenizer")
    from wamrl.policy.fastwam import INSTALL_HINT, _default_dtype

    try:
        from fastwam.models.wan22.helpers.io import load_state_dict
        from fastwam.models.wan22.wan_video_text_encoder import (
            HuggingfaceTokenizer,
            WanTextEncoder,
        )
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e

    dtype = fcfg.torch_dtype
    tokenizer = HuggingfaceTokenizer(
        name=str(tok_path), seq_len=fcfg.context_len, clean="whitespace"
    )
    with torch.device(device), _default_dtype(dtype):
        encoder = WanTextEncoder().eval().requires_grad_(False)
    state = load_state_dict(str(enc_path), torch_dtype=dtype, device="cpu")
    result = encoder.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{enc_path}: not the umT5-xxl encoder: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )

    @torch.no_grad()
    def encode(prompts: list[str]) -> tuple[Tensor, Tensor]:
        ids, mask = tokenizer(prompts, return_mask=True, add_special_tokens=True)
        ids, mask = ids.to(device), mask.to(device, torch.bool)
        emb = encoder(ids, mask)
        return zero_padding(emb, mask)

    return encode


def zero_padding(emb: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """FastWAM.encode_prompt: embeddings past each prompt's length are 0; the mask is all True."""
    emb = emb.clone()
    for i, n in enumerate(mask.bool().sum(dim=1).tolist()):
        emb[i, n:] = 0
    return emb, torch.ones_like(mask, dtype=torch.bool)


def _meta(cfg: dict[str, Any], tasks: Sequence[Any]) -> dict[str, Any]:
    f = cfg["policy"]["fastwam"]
    return {
        "template": prompt_template(),
        "names": [t.name for t in tasks],
        "prompts": prompts_for(tasks),
        "text_encoder": str(f.get("text_encoder")),
        "tokenizer": str(f.get("tokenizer")),
        "context_len": int(f["context_len"]),
        "dtype": str(f["dtype"]),
    }


def task_contexts(
    cfg: dict[str, Any],
    run_dir: Path,
    tasks: Sequence[Any] | None = None,
    encoder: Encoder | None = None,
) -> tuple[Tensor, Tensor]:
    """(context [N, L, D], mask [N, L]) for the tasks, from <run_dir>/context/ when it matches,
    else computed (loading the text encoder) and written there first."""
    from wamrl.envs.tasks import load_tasks
    from wamrl.policy.text import load_contexts

    tasks = list(load_tasks() if tasks is None else tasks)
    out = Path(run_dir) / CONTEXT_DIR
    meta = _meta(cfg, tasks)
    info = out / CONTEXT_JSON
    fresh = (out / CONTEXT_FILE).is_file() and info.is_file()
    if fresh and read_json(info, "the context cache's record") == meta:
        return load_contexts(out / CONTEXT_FILE)
    write_contexts(cfg, out, tasks, encoder)
    return load_contexts(out / CONTEXT_FILE)


def write_contexts(
    cfg: dict[str, Any], out: Path, tasks: Sequence[Any], encoder: Encoder | None = None
) -> None:
    from wamrl.policy.text import save_contexts

    meta = _meta(cfg, tasks)
    if encoder is None:
        encoder = official_encoder(cfg)
    context, mask = encoder(meta["prompts"])
    L = int(cfg["policy"]["fastwam"]["context_len"])
    if context.shape[:2] != (len(tasks), L) or mask.shape != (len(tasks), L):
        raise ValueError(
            f"text encoder returned context {tuple(context.shape)} / mask {tuple(mask.shape)}, "
            f"expected [{len(tasks)}, {L}, D] / [{len(tasks)}, {L}]"
        )
    with atomic_dir(out) as tmp:
        save_contexts(tmp / CONTEXT_FILE, meta["names"], context.cpu(), mask.cpu().bool())
        (tmp / CONTEXT_JSON).write_text(json.dumps(meta, indent=1))
