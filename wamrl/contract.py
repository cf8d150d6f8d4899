"""The data contract between the envs, the stores and the model: one home for its numbers.

A real Fast-WAM checkpoint works only if these match what it was trained on exactly, so
every module reads them from here. Torch-free: the stores and the env workers import it.

- A query returns a chunk of CHUNK_LEN actions of ACTION_DIM (the RL action is the whole
  chunk); the proprio state has PROPRIO_DIM values.
- The model image is IMAGE_HW: agentview | wrist, each MODEL_HW square, side by side.
- Video frames are every FRAME_STRIDE-th env step, so the world model imagines the frames
  FRAME_OFFSETS env steps after a query; rollouts render exactly those as `step/frames`.
- Pixels enter the model as x * 2 / 255 - 1 (`uint8_to_model`).
"""

from __future__ import annotations

from typing import Any

CHUNK_LEN = 32  # actions per query
ACTION_DIM = 7
PROPRIO_DIM = 8
MODEL_HW = 224  # each camera's side in the model image
IMAGE_HW = (MODEL_HW, 2 * MODEL_HW)  # agentview | wrist, side by side
FRAME_STRIDE = 4  # the video's frame spacing in env steps
N_FUTURE = 2  # future frames per query that the reward compares
FRAME_OFFSETS = tuple(FRAME_STRIDE * (i + 1) for i in range(N_FUTURE))  # (4, 8) env steps


def uint8_to_model(images: Any) -> Any:
    """uint8 tensor [..., H, W, 3] -> float32 [..., 3, H, W] in [-1, 1] (x * 2 / 255 - 1).

    Takes a torch tensor; duck-typed so that this module stays torch-free.
    """
    return images.movedim(-1, -3).float() * (2.0 / 255.0) - 1.0
