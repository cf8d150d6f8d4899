"""LoRA for nn.Linear: y = W x + (alpha / r) B A x, with B = 0 at init (no output change).

Without autograd (rollout, eval, reward) the update is folded into one weight,
W + (alpha / r) B A, kept until any of W, A, B changes (tracked by their version counters):
a rank-64 side path would otherwise cost about half the video expert's matmuls again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None):
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = (alpha if alpha is not None else rank) / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

        self._folded: tuple[tuple[int, ...], Tensor] | None = None

    def _versions(self) -> tuple[int, ...]:
        w, a, b = self.base.weight, self.lora_a, self.lora_b
        return (w._version, a._version, b._version, w.data_ptr(), a.data_ptr(), b.data_ptr())

    def folded_weight(self) -> Tensor:
        key = self._versions()
        if self._folded is None or self._folded[0] != key:
            with torch.no_grad():
                # B = 0 (fresh, or just merged) is W itself: no second copy of a big weight.
                w = self.base.weight
                if bool(self.lora_b.any()):
                    w = w + (self.lora_b @ self.lora_a) * self.scale
            self._folded = (key, w)
        return self._folded[1]

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            return F.linear(x, self.folded_weight(), self.base.bias)
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def add_lora(module: nn.Module, rank: int) -> nn.Module:
    """Replace every nn.Linear inside `module` by a LoRALinear wrapper (in place)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, LoRALinear(child, rank))
        else:
            add_lora(child, rank)
    return module


def lora_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in module.named_parameters() if n.rsplit(".", 1)[-1] in ("lora_a", "lora_b")]
