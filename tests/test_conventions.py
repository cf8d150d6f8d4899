"""Fast unit tests of Fast-WAM's env conventions (no LIBERO)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from wamrl.envs.conventions import (
    DUMMY_ACTION,
    Normalizer,
    _crop_resize,
    env_actions,
    gripper_from_env,
    gripper_to_env,
    image_to_model_input,
    model_image,
    quat2axisangle,
    raw_proprio,
)


def _ramp(h: int, w: int, axis: int) -> np.ndarray:
    """uint8 image whose value is the column (axis=1) or row (axis=0) index (indices < 256)."""
    idx = np.arange(w if axis == 1 else h, dtype=np.float64)
    grid = np.broadcast_to(idx[None, :] if axis == 1 else idx[:, None], (h, w))
    return np.repeat(grid[..., None], 3, axis=2).astype(np.uint8)


def test_model_image_shape_and_concatenation():
    agent = np.full((256, 256, 3), 10, np.uint8)
    wrist = np.full((256, 256, 3), 200, np.uint8)
    out = model_image(agent, wrist)
    assert out.shape == (224, 448, 3) and out.dtype == np.uint8
    assert (out[:, :224] == 10).all() and (out[:, 224:] == 200).all()


@pytest.mark.parametrize("axis", [0, 1])
def test_model_image_rotates_180_and_resizes_bilinear(axis: int):
    # A linear ramp stays linear under a (symmetric) bilinear filter, so interior pixels
    # follow the formula: output pixel j samples input (j + 0.5) / s - 0.5 of the rotated
    # image, whose value there is 255 - coordinate.
    raw = _ramp(256, 256, axis)
    out = model_image(raw, raw)[:, :224, 0].astype(np.float64)
    s = 224 / 256
    j = np.arange(224)
    expected = 255.0 - ((j + 0.5) / s - 0.5)
    profile = out[:, 100] if axis == 0 else out[100, :]
    assert np.abs(profile[4:-4] - expected[4:-4]).max() <= 1.0


def test_crop_resize_centre_crops_non_square():
    # 256 x 320: scale = max(224/320, 224/256) = 0.875 -> 280 x 224, crop columns 28..251.
    cols = np.round(np.arange(320) * 0.75)  # values stay below 256
    raw = np.broadcast_to(cols[None, :, None], (256, 320, 3)).astype(np.uint8)
    out = _crop_resize(raw).astype(np.float64)
    assert out.shape == (224, 224, 3)
    j = np.arange(28, 28 + 224)
    expected = 0.75 * ((j + 0.5) / 0.875 - 0.5)
    assert np.abs(out[50, 4:-4, 0] - expected[4:-4]).max() <= 1.0


def test_model_image_rejects_bad_input():
    with pytest.raises(ValueError):
        model_image(np.zeros((256, 256, 3), np.float32), np.zeros((256, 256, 3), np.uint8))


def test_image_to_model_input_scale_and_layout():
    img = np.random.default_rng(0).integers(0, 256, (2, 224, 448, 3)).astype(np.uint8)
    x = image_to_model_input(img)
    assert x.shape == (2, 3, 224, 448) and x.dtype == torch.float32
    ref = img.astype(np.float32) * 2 / 255 - 1
    np.testing.assert_allclose(x.numpy(), ref.transpose(0, 3, 1, 2), atol=1e-6)
    edge = image_to_model_input(np.array([[[0, 255, 0]]], np.uint8))
    assert edge.flatten().tolist() == [-1.0, 1.0, -1.0]


def test_quat2axisangle_inverts_axis_angle():
    rng = np.random.default_rng(1)
    for _ in range(20):
        axis = rng.normal(size=3)
        axis /= np.linalg.norm(axis)
        angle = rng.uniform(0.01, np.pi - 0.01)
        quat = np.r_[axis * np.sin(angle / 2), np.cos(angle / 2)]  # xyzw
        np.testing.assert_allclose(quat2axisangle(quat), axis * angle, atol=1e-9)
    assert np.array_equal(quat2axisangle(np.array([0.0, 0, 0, 1])), np.zeros(3))


def test_raw_proprio_layout():
    angle = 0.3
    obs = {
        "robot0_eef_pos": np.array([0.1, -0.2, 1.0]),
        "robot0_eef_quat": np.array([0.0, 0.0, np.sin(angle / 2), np.cos(angle / 2)]),
        "robot0_gripper_qpos": np.array([0.04, -0.04]),
    }
    p = raw_proprio(obs)
    assert p.dtype == np.float32 and p.shape == (8,)
    np.testing.assert_allclose(p, [0.1, -0.2, 1.0, 0, 0, angle, 0.04, -0.04], atol=1e-6)


def _stats() -> dict:
    def entry(lo, hi):
        lo, hi = np.asarray(lo, float), np.asarray(hi, float)
        mid = ((lo + hi) / 2).tolist()
        return {
            "min": lo.tolist(),
            "max": hi.tolist(),
            "mean": mid,
            "std": mid,
            "q01": mid,
            "q99": mid,
        }

    return {
        "source": "test",
        "state": {"s": entry([-1, 0, 0.5, 0, 0, 0, 0.0, -0.04], [1, 2, 1.5, 3, 3, 3, 0.04, 0.0])},
        "action": {"a": entry([-1, -1, -1, -0.5, -0.5, -0.5, 0], [1, 1, 1, 0.5, 0.5, 0.5, 1])},
    }


def test_normalizer_minmax_and_constant_dims():
    stats = _stats()
    stats["state"]["s"]["max"][2] = stats["state"]["s"]["min"][2] + 5e-5  # constant dim
    norm = Normalizer(stats)
    lo = np.asarray(stats["state"]["s"]["min"])
    hi = np.asarray(stats["state"]["s"]["max"])
    assert np.allclose(norm.normalize_state(lo)[[0, 1, 3]], -1)
    assert np.allclose(norm.normalize_state(hi)[[0, 1, 3]], 1)
    assert norm.normalize_state(hi)[2] == 0.0 and norm.normalize_state(lo)[2] == 0.0
    x = np.array([0.5, 1.5, 0.5, 1.0, 2.0, 0.0, 0.01, -0.03])
    expected = 2 * (x - lo) / (hi - lo) - 1
    got = norm.normalize_state(x)
    np.testing.assert_allclose(np.delete(got, 2), np.delete(expected, 2), rtol=1e-6)
    far = norm.normalize_state(hi + 100.0)
    assert far[0] == 5.0 and far[2] == 0.0


def test_normalizer_round_trips(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(_stats()))
    norm = Normalizer.load(path)
    rng = np.random.default_rng(2)
    lo = np.asarray(_stats()["state"]["s"]["min"])
    hi = np.asarray(_stats()["state"]["s"]["max"])
    x = lo + rng.random((16, 8)) * (hi - lo)
    np.testing.assert_allclose(norm.denormalize_state(norm.normalize_state(x)), x, atol=1e-6)
    y = rng.uniform(-1, 1, (32, 7))
    np.testing.assert_allclose(norm.normalize_action(norm.denormalize_action(y)), y, atol=1e-6)


def test_normalizer_needs_one_key():
    stats = _stats()
    stats["state"]["other"] = stats["state"]["s"]
    with pytest.raises(ValueError):
        Normalizer(stats)
    assert Normalizer(stats, state_key="s").state_dim == 8


def test_gripper_convention():
    # data 1 = open -> LIBERO -1 (open); data 0 = closed -> +1 (close); 0.5 -> -1 (open).
    assert gripper_to_env(np.array([1.0, 0.9, 0.0, 0.1, 0.5])).tolist() == [-1, -1, 1, 1, -1]
    assert gripper_to_env(gripper_from_env(np.array([-1.0, 1.0]))).tolist() == [-1, 1]


def test_env_actions():
    norm = Normalizer(_stats())
    rng = np.random.default_rng(3)
    chunk = rng.uniform(-1, 1, (32, 7))
    chunk[:, 6] = np.where(np.arange(32) % 2 == 0, 0.8, -0.8)
    acts = env_actions(chunk, norm, replan=10)
    assert acts.shape == (10, 7) and acts.dtype == np.float64
    # Translation: [-1, 1] -> [-1, 1]; rotation: [-1, 1] -> [-0.5, 0.5].
    np.testing.assert_allclose(acts[:, :3], chunk[:10, :3])
    np.testing.assert_allclose(acts[:, 3:6], chunk[:10, 3:6] * 0.5)
    # y = 0.8 -> g = 0.9 (open) -> -1; y = -0.8 -> g = 0.1 (closed) -> +1.
    assert acts[:, 6].tolist() == [-1.0, 1.0] * 5
    with pytest.raises(ValueError):
        env_actions(chunk[:5], norm, replan=10)


def test_dummy_action():
    assert DUMMY_ACTION.tolist() == [0, 0, 0, 0, 0, 0, -1]
