"""What the learners (actor and world model) share: their optimizer, the parameters it trains,
its state on disk, and the error that stops an update with non-finite numbers."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from wamrl.master import MasterWeightOptimizer
from wamrl.policy.base import Policy


class NonFiniteError(RuntimeError):
    """A NaN/Inf in the loss, gradients or parameters: the stage stops before writing."""


def trainable_optimizer(
    policy: Policy, group: str, lr: float, beta1: float = 0.9
) -> tuple[list[nn.Parameter], MasterWeightOptimizer]:
    """Adam over `policy.parameter_groups()[group]`, the only parameters left requiring grad
    (the rest of the model is frozen in that stage: no gradients computed or kept for it).
    Float32 masters for non-float32 (bf16) parameters, so small steps do not round away;
    a no-op wrapper on float32 ones. beta1: Adam's momentum (the second moment's beta stays
    0.999). Returns (the group's parameters, the optimizer)."""
    params = list(policy.parameter_groups()[group])
    ids = {id(p) for p in params}
    for p in policy.parameters():
        p.requires_grad_(id(p) in ids)
    return params, MasterWeightOptimizer(
        params, lambda ps: torch.optim.Adam(ps, lr=lr, betas=(beta1, 0.999))
    )


# ---- optimizer state as safetensors (no pickle) -------------------------------------------


def param_names(policy: nn.Module, params: list[nn.Parameter]) -> list[str]:
    """Names (as in policy.state_dict()) of the given parameters, in order."""
    by_id = {id(p): n for n, p in policy.named_parameters()}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise KeyError(f"parameters {missing} of the group are not registered in the policy")
    return [by_id[id(p)] for p in params]


def optimizer_to_tensors(
    optimizer: torch.optim.Optimizer, names: list[str]
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Flatten a single-group Adam(W) state to {"<param>.exp_avg", ".exp_avg_sq", ".step"}."""
    params = optimizer.param_groups[0]["params"]
    if len(params) != len(names):
        raise ValueError("names must match the optimizer's parameters one to one")
    tensors: dict[str, Tensor] = {}
    for name, p in zip(names, params, strict=True):
        st = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in st:
                v = st[key]
                v = v if torch.is_tensor(v) else torch.tensor(float(v))
                tensors[f"{name}.{key}"] = v.detach().cpu().contiguous().reshape(v.shape)
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    meta = {
        "type": type(optimizer).__name__,
        "params": names,
        "param_group": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in group.items()
            if isinstance(v, (int, float, bool, str, tuple, type(None)))
        },
    }
    return tensors, meta


def optimizer_from_tensors(
    optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, Tensor]
) -> int:
    """Load what optimizer_to_tensors wrote into a fresh optimizer; returns params restored.

    Parameters absent from the file start with an empty state; a shape mismatch names it.
    """
    params = optimizer.param_groups[0]["params"]
    restored = 0
    for name, p in zip(names, params, strict=True):
        if f"{name}.exp_avg" not in tensors:
            continue
        st: dict[str, Tensor] = {}
        for key in ("exp_avg", "exp_avg_sq"):
            v = tensors[f"{name}.{key}"]
            if v.shape != p.shape:
                raise ValueError(
                    f"optimizer state {name}.{key} has shape {tuple(v.shape)}, "
                    f"parameter has {tuple(p.shape)}"
                )
            st[key] = v.to(p.device, p.dtype).clone()
        st["step"] = tensors[f"{name}.step"].float().clone()
        optimizer.state[p] = st
        restored += 1
    return restored
