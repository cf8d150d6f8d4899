"""The one policy interface every stage uses (docs/design.md "The policy").

A backend is a World Action Model: a video expert and an action expert joined per layer
under Fast-WAM's attention mask. Stages never see backend internals; they call:

    cache = policy.prefill(obs)                    # first-frame K/V cache (+ proprio, text)
    v     = policy.velocity(cache, x, sigma)       # action-expert velocity v = eps - a
    fut   = policy.imagine(obs, num_future, steps) # world model: frames at +4, +8, ... (pixels)
    policy.video_loss(...), policy.action_loss(...), policy.features(...)
    policy.parameter_groups()                      # {"actor": [...], "world_model": [...]}
    policy.save(dir); Backend.load(dir)

Flow convention (Fast-WAM, Flow-GRPO, piRL): x_sigma = (1 - sigma) * a + sigma * eps,
the model predicts v = eps - a; sigma = 1 is noise, sigma = 0 is data.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn


def generator_device(generator: torch.Generator | None) -> torch.device:
    """Where random numbers from `generator` are drawn (torch's default CPU one without)."""
    return generator.device if generator is not None else torch.device("cpu")


@dataclass
class Obs:
    """A batch of model inputs (the MDP state, seed 004 section 4.2)."""

    image: Tensor  # [B, 3, 224, 448] float32 in [-1, 1]
    proprio: Tensor  # [B, 8] normalised to [-1, 1]
    context: Tensor  # [B, L, Dc] per-task text context, precomputed once per task
    context_mask: Tensor  # [B, L] bool, True where a token exists

    def to(self, device: torch.device | str) -> Obs:
        return Obs(
            *(t.to(device) for t in (self.image, self.proprio, self.context, self.context_mask))
        )

    @property
    def batch_size(self) -> int:
        return self.image.shape[0]


class Policy(nn.Module, ABC):
    """Abstract World Action Model backend. Backends register by name in wamrl.policy."""

    backend: ClassVar[str]

    @abstractmethod
    def prefill(self, obs: Obs) -> Any:
        """Run the video expert on the current (clean) frame and keep each layer's K/V.

        The returned cache is what every denoising step's action tokens attend to.
        """

    @abstractmethod
    def velocity(self, cache: Any, x: Tensor, sigma: Tensor) -> Tensor:
        """Action velocity v(x, sigma) over the cache. x: [B, 32, 7], sigma: [B] -> [B, 32, 7]."""

    @abstractmethod
    def imagine(
        self, obs: Obs, num_future: int, steps: int, generator: torch.Generator | None = None
    ) -> Tensor:
        """Deterministically denoise the next `num_future` video frames (+4, +8, ... env steps)
        from the current frame and decode them: [B, num_future, 3, 224, 448] in [-1, 1]."""

    @abstractmethod
    def video_loss(
        self,
        video: Tensor,
        context: Tensor,
        context_mask: Tensor,
        proprio: Tensor,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Video flow-matching loss. video: [B, F, 3, 224, 448] in [-1, 1], frames 4 env steps
        apart; frame 0 is the clean condition (per-token timesteps: first frame sigma = 0)."""

    @abstractmethod
    def action_loss(
        self, obs: Obs, actions: Tensor, generator: torch.Generator | None = None
    ) -> Tensor:
        """Action flow-matching loss for normalised chunks actions: [B, 32, 7]."""

    @abstractmethod
    def features(
        self, video: Tensor, context: Tensor, context_mask: Tensor, proprio: Tensor
    ) -> Tensor:
        """Video-expert features of a clean window, [B, N, D], for the world-model feature KL."""

    def compile_layers(self) -> bool:
        """torch.compile this model's per-layer work in place (fusing its many small
        elementwise kernels), for a copy that only answers queries. False: nothing to
        compile in this backend."""
        return False

    @abstractmethod
    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """{"actor": action expert + proprio encoder, "world_model": LoRA on the video expert}."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write model.safetensors + policy.yaml into `directory` (no pickles)."""

    @classmethod
    @abstractmethod
    def load(cls, directory: Path, device: str | torch.device = "cpu") -> Policy:
        """Load what `save` wrote; a missing file, key or shape mismatch names the tensor."""
