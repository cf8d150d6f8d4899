"""The rollout query (prefill + K denoising steps) replayed as one CUDA graph per batch size.

At tiny and small dims a query is launch-bound: hundreds of small kernels, each a few
microseconds of GPU work behind tens of microseconds of Python and launch. A CUDA graph
records them once and replays them with one launch. What that needs, and how it is met:

- Fixed shapes: a waiting batch is padded (row 0 repeated) to the next bucket size
  (1, 2, 4, ... up to the number of envs); the padding rows are dropped afterwards. Every
  row of the model is independent of the others, so padding changes no real row.
- No host work inside: all randomness (x_0, k*, the SDE noise) is drawn on the CPU
  generator first, in exactly the order `sampler.sample_chunk` draws it, and copied into
  static buffers; the SDE step is selected per row with torch.where instead of an `if`.
  So a graphed query gives the eager sampler's chain, k* and log pi_old for the same
  generator state (tests/test_graphed.py checks it on CPU through the same code path).
- Weights change between iterations (a new checkpoint, or in-place updates): a graph
  keeps pointers, and the folded LoRA weight it captured would be stale, so every graph is
  dropped and re-captured when any parameter's storage or version has changed.
- Log-probs stay float32: velocities are cast to float32 before the sampler math. With
  sampler.amp the model runs under autocast, recorded into the graph like any other op.
- sampler.compile: the query copy's layers are torch.compile'd (Policy.compile_layers) and
  warmed up before capture, so a graph records the fused Triton kernels: at full size a
  query is ~40 small kernels per layer and step, and their count, not FLOPs, sets latency.
- Weights in the autocast dtype: autocast casts every fp32 matmul weight again on every
  call (its cast cache cannot live inside a graph), which at full size reads and writes
  more bytes than the bf16 matmuls themselves. So queries run a copy of the policy whose
  Linear and Conv weights are stored in that dtype once per weights (LoRA folded in first,
  as the fp32 path folds it); norms stay fp32. Autocast would have made exactly those casts,
  so the result is the same to the bit (tests/test_graphed.py).

On a CPU device the same static-noise path runs eagerly (no graph), which is what the
tests compare against `sample_chunk`.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from wamrl.policy.base import Obs, Policy
from wamrl.policy.lora import LoRALinear
from wamrl.runtime import autocast
from wamrl.sampler import SampleResult, denoise, draw_noise, sigma_schedule


def denoise_static(
    policy: Policy,
    obs: Obs,
    x0: Tensor,
    k_star: Tensor,
    xi: Tensor,
    sigmas: Tensor,
    a: float,
) -> tuple[Tensor, Tensor]:
    """prefill + K steps with no host synchronisation: (chain [B, K+1, 32, 7], logp [B])."""
    return denoise(policy, policy.prefill(obs), x0, k_star, xi, sigmas, a)


MATMUL_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d)


def matmul_weights_in(
    policy: Policy, dtype: torch.dtype | None, always_copy: bool = False
) -> Policy:
    """A no-grad copy of `policy` whose Linear / Conv weights and biases are stored in `dtype`
    (None: as they are), LoRA folded in (each LoRALinear becomes its base Linear); other
    tensors are copied, weights already in `dtype` are shared. Under autocast to `dtype` it
    computes what the policy computes under that autocast, without casting every weight on
    every call. Returns the policy itself when there is nothing to cast (the Fast-WAM
    backend in bf16), unless always_copy (a copy to compile: see Policy.compile_layers)."""
    layers = [m for m in policy.modules() if isinstance(m, MATMUL_MODULES)]
    if not always_copy and all(dtype in (None, m.weight.dtype) for m in layers):
        return policy

    def low(t: Tensor) -> nn.Parameter:  # shares storage where t is in dtype already
        return nn.Parameter(t.detach().to(dtype or t.dtype), requires_grad=False)

    memo: dict[int, object] = {}  # deepcopy's memo: what each original tensor becomes
    with torch.no_grad():
        for m in policy.modules():
            if isinstance(m, LoRALinear):
                w = m.folded_weight()  # W + scale B A, memoised on the module (or W itself)
                memo[id(m.base.weight)] = memo[id(w)] = low(w)
                memo[id(m.lora_a)] = memo[id(m.lora_b)] = None  # folded in: not copied
        for m in layers:
            if id(m.weight) not in memo:  # a LoRA base weight is there already, folded
                memo[id(m.weight)] = low(m.weight)
            if m.bias is not None:
                memo[id(m.bias)] = low(m.bias)
    shadow = copy.deepcopy(policy, memo)
    for name, m in list(shadow.named_modules()):
        if isinstance(m, LoRALinear):
            parent, _, attr = name.rpartition(".")
            setattr(shadow.get_submodule(parent), attr, m.base)
    return shadow.eval().requires_grad_(False)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]  # image, proprio, context, mask, x0, k_star, xi
    chain: Tensor
    logp: Tensor


class GraphedSampler:
    """`query(obs, generator, x0)` -> SampleResult, equal to prefill + sample_chunk."""

    def __init__(
        self,
        policy: Policy,
        K: int,
        a: float,
        shift: float,
        max_batch: int,
        amp: torch.dtype | None = None,
        cast_once: bool = True,
        compile: bool = False,
        fixed_batch: bool = False,
        kstar_max: int | None = None,
    ):
        """cast_once False keeps autocast's per-call weight casts (benchmarks compare).
        compile: queries run a copy whose layers are compiled (Policy.compile_layers) before
        the graphs record them; the copy shares the fp32 weights or holds the amp ones.
        fixed_batch: one graph, of max_batch rows, for every query (eval pads every batch to
        that size, so that a row's result does not depend on the batch it came in).
        kstar_max: the highest SDE step (sampler.draw_noise)."""
        self.policy, self.K, self.a, self.amp = policy, K, a, amp
        self.kstar_max = kstar_max
        self.cast_once, self.compile = cast_once, compile
        self.device = next(policy.parameters()).device
        self.sigmas = sigma_schedule(K, shift).to(self.device)
        self.buckets = [max_batch] if fixed_batch else [1]
        while self.buckets[-1] < max_batch:
            self.buckets.append(min(2 * self.buckets[-1], max_batch))
        self.use_graphs = self.device.type == "cuda"
        self._graphs: dict[tuple, _Graph] = {}
        self._signature: tuple | None = None
        self._model: Policy = policy  # what queries run: the policy or a copy (_sync_weights)
        self.captures = 0  # graphs captured so far (benchmarks and tests read it)

    def weights_signature(self) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in self.policy.parameters())

    def bucket(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} exceeds max_batch {self.buckets[-1]}")

    @torch.no_grad()
    def query(
        self,
        obs: Obs,
        generator: torch.Generator | None,
        x0: Tensor | None = None,
        k_star: Tensor | None = None,
        xi: Tensor | None = None,
    ) -> SampleResult:
        """x0, k_star, xi: per-row noise (graph inputs like the observation), else drawn
        from `generator` as sample_chunk draws it."""
        batch = obs.batch_size
        self._sync_weights()
        x0, k_star, xi = draw_noise(
            batch, self.K, self.a, generator, x0, k_star, xi, self.kstar_max
        )
        inputs = (obs.image, obs.proprio, obs.context, obs.context_mask, x0, k_star, xi)
        if self.use_graphs:
            size = self.bucket(batch)
            try:
                g = self._graph_for(size, inputs)
            except RuntimeError as err:  # an op that cannot be captured: stay correct, go eager
                if self.compile:  # e.g. Inductor without a C compiler: the eager path fails too
                    raise RuntimeError(
                        f"sampler.compile: the compiled query could not run ({err}); "
                        "set sampler.compile: false to run it uncompiled"
                    ) from err
                warnings.warn(
                    f"CUDA graph capture failed ({err}); queries run eagerly", stacklevel=2
                )
                self.use_graphs = False
            else:
                for dst, src in zip(g.inputs, inputs, strict=True):
                    dst[:batch].copy_(src, non_blocking=True)
                    if size > batch:
                        pad = src[:1].expand(size - batch, *src.shape[1:])
                        dst[batch:].copy_(pad, non_blocking=True)
                g.graph.replay()
                return SampleResult(
                    g.chain[:batch].clone(), k_star.to(self.device), g.logp[:batch].clone()
                )
        dev = [t.to(self.device) for t in inputs]
        chain, logp = self._denoise(Obs(*dev[:4]), *dev[4:])
        return SampleResult(chain, dev[5], logp)

    def _sync_weights(self) -> None:
        """New or updated weights: every graph (it holds pointers) and the low-precision
        copy are stale."""
        signature = self.weights_signature()
        if signature != self._signature:
            self._graphs.clear()
            self._model = self.policy  # the old copy goes before the new one is made
            store = self.amp if self.cast_once else None  # weights kept in the autocast dtype
            if store is not None or self.compile:
                self._model = matmul_weights_in(self.policy, store, always_copy=self.compile)
                if self.compile and not self._model.compile_layers():
                    warnings.warn(f"{type(self.policy).__name__}: nothing to compile", stacklevel=2)
            self._signature = signature

    def _denoise(self, obs: Obs, *noise: Tensor) -> tuple[Tensor, Tensor]:
        with autocast(self.device, self.amp):
            return denoise_static(self._model, obs, *noise, sigmas=self.sigmas, a=self.a)

    def warm_up(self, obs: Obs) -> int:
        """Query every bucket once with obs's first row repeated (throwaway noise), so that a
        run after it replays graphs and never stops to capture. Returns the graphs captured.
        A rollout pays this once per weights anyway; a benchmark wants it outside its timer."""
        before = self.captures
        gen = torch.Generator().manual_seed(0)
        for size in self.buckets:
            rows = torch.zeros(size, dtype=torch.long, device=obs.image.device)
            self.query(Obs(*(t[rows] for t in (obs.image, obs.proprio, obs.context,
                                               obs.context_mask))), gen)  # fmt: skip
        return self.captures - before

    def _graph_for(self, size: int, inputs: tuple[Tensor, ...]) -> _Graph:
        key = (size,) + tuple(tuple(t.shape[1:]) + (t.dtype,) for t in inputs)
        if key not in self._graphs:
            self._graphs[key] = self._capture(size, inputs)
        return self._graphs[key]

    def _capture(self, size: int, like: tuple[Tensor, ...]) -> _Graph:
        static = tuple(
            torch.zeros((size, *t.shape[1:]), dtype=t.dtype, device=self.device) for t in like
        )
        for dst, src in zip(static, like, strict=True):  # real values: masks must not be empty
            dst.copy_(src[:1].expand(size, *src.shape[1:]))

        def run() -> tuple[Tensor, Tensor]:
            return self._denoise(Obs(*static[:4]), *static[4:])

        # Warm-up on a side stream (cuBLAS/cuDNN workspaces, memoised folded weights), then
        # record; the capture pool is private to this graph.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain, logp = run()
        self.captures += 1
        return _Graph(graph, static, chain, logp)
