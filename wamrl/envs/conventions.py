"""Fast-WAM's LIBERO conventions as pure functions (docs/design.md "Environment conventions").

The real checkpoint only works if these match its eval code exactly:
- image: both 256 px cameras rotated 180 deg, centre-crop-resized to 224 px (PIL bilinear),
  side by side [agentview | wrist], then x * 2 / 255 - 1;
- proprio: eef_pos(3) + axis-angle(eef_quat)(3) + gripper_qpos(2), min/max-normalised;
- action: de-normalised with the same statistics; the gripper g -> 2g - 1 -> negated -> sign
  (the data stores 1 = open; LIBERO wants -1 = open, +1 = close).

Only numpy and PIL here: env worker processes import this module and should not pay for
torch (it is imported lazily by `image_to_model_input`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from wamrl.contract import MODEL_HW, uint8_to_model

if TYPE_CHECKING:
    import torch

DUMMY_ACTION = np.array(
    [0, 0, 0, 0, 0, 0, -1], dtype=np.float64
)  # settle steps: hold, gripper open
RANGE_EPS = 1e-4  # dims whose max - min is below this are constant: they normalise to 0
NORM_CLAMP = 5.0  # normalised state is clamped to [-5, 5]


def _crop_resize(img: np.ndarray, size: int = MODEL_HW) -> np.ndarray:
    """Resize so the short side is `size` (PIL bilinear), then crop the centre size x size."""
    h, w = img.shape[:2]
    scale = max(size / w, size / h)
    new_w, new_h = round(w * scale), round(h * scale)
    resized = np.asarray(Image.fromarray(img).resize((new_w, new_h), Image.BILINEAR))
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return resized[top : top + size, left : left + size]


def model_image(agent_raw: np.ndarray, wrist_raw: np.ndarray) -> np.ndarray:
    """Raw (upside-down) LIBERO camera images -> the model image, uint8 [224, 448, 3]."""
    views = []
    for raw in (agent_raw, wrist_raw):
        if raw.ndim != 3 or raw.shape[2] != 3 or raw.dtype != np.uint8:
            raise ValueError(f"expected a uint8 [H, W, 3] image, got {raw.dtype} {raw.shape}")
        # LIBERO renders in OpenGL convention (bottom row first): rotate 180 deg.
        views.append(_crop_resize(np.ascontiguousarray(raw[::-1, ::-1])))
    return np.concatenate(views, axis=1)


def image_to_model_input(image: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 [..., 224, 448, 3] -> float32 torch [..., 3, 224, 448] in [-1, 1]."""
    import torch

    t = torch.as_tensor(image)
    if t.dtype != torch.uint8:
        raise ValueError(f"expected uint8 image, got {t.dtype}")
    return uint8_to_model(t)


def quat2axisangle(quat_xyzw: np.ndarray) -> np.ndarray:
    """Unit quaternion (x, y, z, w) -> axis * angle, angle in [0, 2 pi] (robosuite's convention)."""
    q = np.asarray(quat_xyzw, dtype=np.float64)
    w = float(np.clip(q[3], -1.0, 1.0))
    den = np.sqrt(1.0 - w * w)
    if np.isclose(den, 0.0):
        return np.zeros(3)  # zero rotation: the axis is undefined
    return q[:3] * 2.0 * np.arccos(w) / den


def raw_proprio(obs: dict[str, Any]) -> np.ndarray:
    """robosuite observation dict -> float32 [8]: eef_pos, axis-angle(eef_quat), gripper_qpos."""
    return np.concatenate(
        [
            np.asarray(obs["robot0_eef_pos"], dtype=np.float64),
            quat2axisangle(obs["robot0_eef_quat"]),
            np.asarray(obs["robot0_gripper_qpos"], dtype=np.float64),
        ]
    ).astype(np.float32)


@dataclass(frozen=True)
class _MinMax:
    low: np.ndarray  # float64 [D]
    high: np.ndarray

    @property
    def valid(self) -> np.ndarray:
        return (self.high - self.low) >= RANGE_EPS

    def forward(self, x: np.ndarray) -> np.ndarray:
        span = np.where(self.valid, self.high - self.low, 1.0)
        y = np.where(self.valid, 2.0 * (x - self.low) / span - 1.0, 0.0)
        return np.clip(y, -NORM_CLAMP, NORM_CLAMP)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        # Constant dims have no information in y: they come back as their (single) value.
        return np.where(self.valid, (y + 1.0) / 2.0 * (self.high - self.low) + self.low, self.low)


def _pick(section: dict[str, Any], kind: str, key: str | None) -> tuple[str, _MinMax]:
    if key is None:
        if len(section) != 1:
            raise ValueError(f"stats[{kind!r}] has keys {sorted(section)}; pass which one to use")
        key = next(iter(section))
    entry = section[key]
    # Fast-WAM's released stats files name them global_min / global_max.
    lo, hi = ("min", "max") if "min" in entry else ("global_min", "global_max")
    if lo not in entry or hi not in entry:
        raise ValueError(f"stats[{kind!r}][{key!r}]: no min/max (or global_min/global_max)")
    low, high = np.asarray(entry[lo], np.float64), np.asarray(entry[hi], np.float64)
    if low.shape != high.shape or low.ndim != 1 or np.any(high < low):
        raise ValueError(f"stats[{kind!r}][{key!r}]: bad min/max {low} {high}")
    return key, _MinMax(low, high)


def stats_entry(x: np.ndarray) -> dict[str, list[float]]:
    """One KEY entry of a Fast-WAM-format statistics file, over the rows of x [N, D]."""
    return {
        "min": x.min(0).tolist(),
        "max": x.max(0).tolist(),
        "mean": x.mean(0).tolist(),
        "std": x.std(0).tolist(),
        "q01": np.quantile(x, 0.01, axis=0).tolist(),
        "q99": np.quantile(x, 0.99, axis=0).tolist(),
    }


class Normalizer:
    """Min/max normalisation to [-1, 1] from a Fast-WAM-format statistics file.

    Format: {"state": {KEY: {"min", "max", "mean", "std", "q01", "q99"}}, "action": {KEY: {...}}}
    with one KEY per kind (other top-level keys, e.g. "source", are ignored).
    """

    def __init__(
        self, stats: dict[str, Any], state_key: str | None = None, action_key: str | None = None
    ):
        self.stats = stats
        self.state_key, self._state = _pick(stats["state"], "state", state_key)
        self.action_key, self._action = _pick(stats["action"], "action", action_key)

    @classmethod
    def load(cls, path: str | Path, **keys: str) -> Normalizer:
        from wamrl.artifact import read_json

        return cls(read_json(path, "normalisation statistics", keys=("state", "action")), **keys)

    @property
    def state_dim(self) -> int:
        return self._state.low.shape[0]

    @property
    def action_dim(self) -> int:
        return self._action.low.shape[0]

    def normalize_state(self, x: np.ndarray) -> np.ndarray:
        """Raw proprio [..., 8] -> float32 in [-1, 1] (clamped to [-5, 5] outside the range)."""
        return self._state.forward(np.asarray(x, np.float64)).astype(np.float32)

    def denormalize_state(self, y: np.ndarray) -> np.ndarray:
        return self._state.inverse(np.asarray(y, np.float64))

    def normalize_action(self, a: np.ndarray) -> np.ndarray:
        return self._action.forward(np.asarray(a, np.float64)).astype(np.float32)

    def denormalize_action(self, y: np.ndarray) -> np.ndarray:
        """Normalised actions [..., 7] -> the data's action space (float64), gripper in data units."""
        return self._action.inverse(np.asarray(y, np.float64))


def gripper_to_env(g: np.ndarray) -> np.ndarray:
    """Data gripper (1 = open, 0 = closed) -> LIBERO's command (-1 = open, +1 = close).

    g -> 2g - 1 -> negated -> sign. np.sign(0) is 0, a half-open command; we send -1 (open)
    for that measure-zero case so the command is always binary.
    """
    s = np.sign(-(2.0 * np.asarray(g, np.float64) - 1.0))
    return np.where(s == 0.0, -1.0, s)


def gripper_from_env(cmd: np.ndarray) -> np.ndarray:
    """Inverse of `gripper_to_env` on {-1, +1}: LIBERO command -> data gripper in [0, 1]."""
    return (1.0 - np.asarray(cmd, np.float64)) / 2.0


def env_actions(chunk_norm: np.ndarray, normalizer: Normalizer, replan: int = 10) -> np.ndarray:
    """Normalised chunk [32, 7] -> the `replan` env actions to execute, float64 [replan, 7]."""
    chunk = np.asarray(chunk_norm, np.float64)
    if chunk.ndim != 2 or chunk.shape[1] != normalizer.action_dim or chunk.shape[0] < replan:
        raise ValueError(
            f"expected a [>= {replan}, {normalizer.action_dim}] chunk, got {chunk.shape}"
        )
    actions = normalizer.denormalize_action(chunk[:replan])
    actions[:, -1] = gripper_to_env(actions[:, -1])
    return actions
