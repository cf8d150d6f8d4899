"""Float32 master weights for parameters stored in a lower precision (bf16 on `fastwam`).

Adam at lr 1e-5 moves a weight by about 1e-5 per step; a bf16 weight of 0.02 has an ulp of
1.2e-4 (2**-13), so such an update rounds away entirely and the checkpoint barely moves
while the loss and gradient metrics look normal. MasterWeightOptimizer keeps a float32
copy of every trainable parameter whose dtype is not float32, lets the inner optimizer
update the copies, and rounds them back into the parameters after each step. Float32
parameters are handed to the inner optimizer themselves, so the tiny (fp32) backend's
update is exactly plain Adam's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

MASTER_DTYPE = torch.float32


class MasterWeightOptimizer:
    """Wraps `make_optimizer(masters)`; the model's parameters keep their own dtype.

    Exposes what ppo.actor_update calls (zero_grad, step) and, through `inner` (whose
    single param group lists the masters in the order of `params`), what
    ppo.optimizer_to_tensors / optimizer_from_tensors read: the Adam state lives on the
    float32 masters, keyed by the same parameter names as before.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        make_optimizer: Callable[[list[Tensor]], torch.optim.Optimizer],
    ) -> None:
        self.params: list[nn.Parameter] = list(params)
        self.masters: list[Tensor] = [
            p if p.dtype == MASTER_DTYPE else p.detach().to(MASTER_DTYPE)  # a new tensor
            for p in self.params
        ]
        # (param, master) for the low-precision ones only: the rest need no copying.
        self._pairs = [(p, m) for p, m in zip(self.params, self.masters, strict=True) if m is not p]
        self.inner = make_optimizer(self.masters)

    @property
    def num_masters(self) -> int:
        """How many parameters have a separate float32 master (0 on an all-fp32 model)."""
        return len(self._pairs)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # lr etc., for anything that reads it
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The masters' grads are scratch (refilled in step); the params' grads are what
        # backward accumulates into.
        self.inner.zero_grad(set_to_none=set_to_none)
        for p, _ in self._pairs:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for p, m in self._pairs:
            # A parameter without a gradient is skipped by Adam, as it would be unwrapped.
            m.grad = None if p.grad is None else p.grad.detach().to(MASTER_DTYPE)
        self.inner.step()
        for p, m in self._pairs:
            if m.grad is not None:
                p.copy_(m)  # rounds to the parameter's dtype (round to nearest even)
                m.grad = None

    @torch.no_grad()
    def sync_params(self) -> None:
        """Round every master into its parameter (after the masters were set directly)."""
        for p, m in self._pairs:
            p.copy_(m)

    # ---- the masters across iterations ---------------------------------------------------

    def master_tensors(self, names: list[str]) -> dict[str, Tensor]:
        """{name: float32 master} for the low-precision parameters only (CPU, contiguous)."""
        by_id = dict(zip(map(id, self.params), names, strict=True))
        return {by_id[id(p)]: m.detach().cpu().contiguous() for p, m in self._pairs}

    @torch.no_grad()
    def load_masters(self, names: list[str], tensors: dict[str, Tensor]) -> int:
        """Restore saved masters that round to exactly the current parameter; returns how many.

        A saved master that does not match (another checkpoint, a changed weight) is
        ignored: that master starts from the parameter, as a fresh one does.
        """
        by_id = dict(zip(map(id, self.params), names, strict=True))
        restored = 0
        for p, m in self._pairs:
            t = tensors.get(by_id[id(p)])
            if t is None or t.shape != m.shape:
                continue
            t = t.to(m.device, MASTER_DTYPE)
            if torch.equal(t.to(p.dtype), p.detach()):
                m.copy_(t)
                restored += 1
        return restored
