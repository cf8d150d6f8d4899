"""The `tiny` backend: cache == joint forward under Fast-WAM's mask, the mask itself,
checkpoints, LoRA, parameter groups, losses and imagination (docs/design.md "The policy")."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from tests.helpers import SMALL_TINY, make_obs, make_tiny_policy
from wamrl.contract import ACTION_DIM, CHUNK_LEN
from wamrl.policy import load_policy
from wamrl.policy.base import Obs
from wamrl.policy.lora import LoRALinear
from wamrl.policy.tiny import TOKENS_PER_FRAME, TinyWAM, fastwam_mask

B = 2  # the batch of make_obs and of conftest's tiny_obs


def noisy_actions(seed: int = 0, b: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, CHUNK_LEN, ACTION_DIM, generator=g), torch.rand(b, generator=g)


def joint(model: TinyWAM, obs: Obs, future: torch.Tensor | None, x, sigma_a, sigma_f=0.7):
    """joint_forward over [first frame (clean), future latents (sigma_f)] and actions."""
    z0 = model.ae.encode(obs.image)[:, None]
    b = z0.shape[0]
    if future is None:
        z, sf = z0, torch.zeros(b, 1)
    else:
        z = torch.cat([z0, future], 1)
        sf = torch.cat([torch.zeros(b, 1), torch.full((b, future.shape[1]), sigma_f)], 1)
    return model.joint_forward(z, sf, x, sigma_a, obs.context, obs.context_mask, obs.proprio)


def future_latents(seed: int, frames: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, frames, SMALL_TINY.latent_channels, 14, 28, generator=g)


# ----------------------------------------------------------------------------- cache and mask


@torch.no_grad()
def test_cached_action_path_equals_joint_forward(tiny_policy: TinyWAM, tiny_obs: Obs) -> None:
    model, obs = tiny_policy, tiny_obs
    x, sigma = noisy_actions()
    v_cached = model.velocity(model.prefill(obs), x, sigma)
    assert v_cached.shape == (B, CHUNK_LEN, ACTION_DIM)
    _, v_joint1, _ = joint(model, obs, None, x, sigma)  # first frame + actions
    _, v_joint3, _ = joint(model, obs, future_latents(1), x, sigma)  # + two future frames
    assert (v_cached - v_joint1).abs().max() <= 1e-5
    assert (v_cached - v_joint3).abs().max() <= 1e-5
    # the velocity depends on what it is given (else the equalities above say nothing)
    x2, sigma2 = noisy_actions(5)
    assert (model.velocity(model.prefill(obs), x2, sigma2) - v_cached).abs().max() > 1e-3
    other = make_obs(9)
    assert (model.velocity(model.prefill(other), x, sigma) - v_cached).abs().max() > 1e-4


@torch.no_grad()
def test_future_video_does_not_reach_the_actions(tiny_policy: TinyWAM, tiny_obs: Obs) -> None:
    model, obs = tiny_policy, tiny_obs
    x, sigma = noisy_actions()
    vv_a, va_a, _ = joint(model, obs, future_latents(1), x, sigma)
    vv_b, va_b, _ = joint(model, obs, future_latents(2), x, sigma, sigma_f=0.3)
    assert (va_a - va_b).abs().max() <= 1e-6  # actions see the first frame only
    assert (vv_a[:, 0] - vv_b[:, 0]).abs().max() <= 1e-6  # so does the first frame
    assert (vv_a[:, 1:] - vv_b[:, 1:]).abs().max() > 1e-3  # the future frames do change
    # video never sees the actions: other action inputs leave the video output unchanged
    x2, sigma2 = noisy_actions(3)
    vv_c, va_c, _ = joint(model, obs, future_latents(1), x2, sigma2)
    assert (vv_a - vv_c).abs().max() <= 1e-6
    assert (va_a - va_c).abs().max() > 1e-3
    vv_d, _, _ = joint(model, obs, future_latents(1), None, None)  # video alone
    assert (vv_a - vv_d).abs().max() <= 1e-6


def _expected_mask(frames: int, na: int) -> np.ndarray:
    """Independent statement of the rule by token role: 0 first frame, 1 future, 2 action."""
    role = [0] * min(frames, 1) * TOKENS_PER_FRAME + [1] * max(frames - 1, 0) * TOKENS_PER_FRAME
    role += [2] * na
    sees = {0: {0}, 1: {0, 1}, 2: {0, 2}}
    return np.array([[rk in sees[rq] for rk in role] for rq in role], dtype=bool)


@pytest.mark.parametrize(("frames", "na"), [(3, 32), (1, 32), (0, 32), (2, 0), (1, 0)])
def test_fastwam_mask_entries(frames: int, na: int) -> None:
    nv = frames * TOKENS_PER_FRAME
    m = fastwam_mask(nv, na, torch.device("cpu"))
    assert m.dtype == torch.bool and m.shape == (nv + na, nv + na)
    np.testing.assert_array_equal(m.numpy(), _expected_mask(frames, na))
    f = min(nv, TOKENS_PER_FRAME)
    assert bool(m[:f, :f].all()) and not bool(m[:f, f:].any())  # first frame: itself only
    assert bool(m[f:nv, :nv].all())  # other video: all video
    assert not bool(m[:nv, nv:].any())  # video never sees actions
    assert bool(m[nv:, nv:].all()) and bool(m[nv:, :f].all())  # actions: actions + first
    assert not bool(m[nv:, f:nv].any())  # ... and no future frame


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_is_bit_exact(
    tmp_path: Path, tiny_policy: TinyWAM, tiny_obs: Obs
) -> None:
    model, obs = tiny_policy, tiny_obs
    model.save(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    meta = yaml.safe_load((tmp_path / "policy.yaml").read_text())
    assert meta["backend"] == "tiny" and meta["config"]["video_dim"] == SMALL_TINY.video_dim
    for loaded in (TinyWAM.load(tmp_path), load_policy(tmp_path)):
        assert isinstance(loaded, TinyWAM) and loaded.cfg == model.cfg
        a, b = model.state_dict(), loaded.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        x, sigma = noisy_actions()
        with torch.no_grad():
            v0 = model.velocity(model.prefill(obs), x, sigma)
            v1 = loaded.eval().velocity(loaded.prefill(obs), x, sigma)
        assert torch.equal(v0, v1)


def _tamper(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "policy.yaml").write_text((src / "policy.yaml").read_text())
    state = load_file(str(src / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_checkpoint_errors_name_the_tensor(tmp_path: Path, tiny_policy: TinyWAM) -> None:
    tiny_policy.save(tmp_path / "ok")
    name = "action_outp.weight"
    bad = _tamper(
        tmp_path / "ok", tmp_path / "shape", lambda s: s.__setitem__(name, torch.zeros(3, 3))
    )
    with pytest.raises(ValueError, match=re.escape(name)):
        TinyWAM.load(bad)
    lora = "video_blocks.1.qkv.lora_b"
    bad = _tamper(tmp_path / "ok", tmp_path / "missing", lambda s: s.pop(lora))
    with pytest.raises(ValueError, match=re.escape(lora)):
        TinyWAM.load(bad)
    bad = _tamper(
        tmp_path / "ok", tmp_path / "extra", lambda s: s.__setitem__("stray.w", torch.zeros(1))
    )
    with pytest.raises(ValueError, match=re.escape("stray.w")):
        TinyWAM.load(bad)
    (tmp_path / "nofile").mkdir()
    (tmp_path / "nofile" / "policy.yaml").write_text((tmp_path / "ok" / "policy.yaml").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        TinyWAM.load(tmp_path / "nofile")


# ----------------------------------------------------------------------------- LoRA and groups


def _strip_lora(module: nn.Module) -> nn.Module:
    for name, child in list(module.named_children()):
        if isinstance(child, LoRALinear):
            setattr(module, name, child.base)
        else:
            _strip_lora(child)
    return module


@torch.no_grad()
def _outputs(model: TinyWAM, obs: Obs) -> list[torch.Tensor]:
    x, sigma = noisy_actions()
    cache = model.prefill(obs)
    vv, va, feats = joint(model, obs, future_latents(1), x, sigma)
    return [*cache.k, *cache.v, model.velocity(cache, x, sigma), vv, va, feats]


def test_lora_at_init_changes_no_output() -> None:
    model, obs = make_tiny_policy().eval(), make_obs()
    wrapped = [m for m in model.video_blocks.modules() if isinstance(m, LoRALinear)]
    plain = [
        m
        for m in model.video_blocks.modules()
        if isinstance(m, nn.Linear) and not any(m is w.base for w in wrapped)
    ]
    assert len(wrapped) == 7 * SMALL_TINY.layers and plain == []  # every video-expert linear
    assert not any(isinstance(m, LoRALinear) for m in model.action_blocks.modules())
    assert all(float(w.lora_b.detach().abs().max()) == 0.0 for w in wrapped)
    assert all(float(w.lora_a.detach().abs().max()) > 0.0 for w in wrapped)
    base = _strip_lora(copy.deepcopy(model))  # the same base weights without LoRA
    assert not any(isinstance(m, LoRALinear) for m in base.modules())
    with_lora, without = _outputs(model, obs), _outputs(base, obs)
    for a, b in zip(with_lora, without, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():  # a trained LoRA does change the video expert and, via the cache,
        wrapped[0].lora_b.normal_(0.0, 0.1)  # the actions
    changed = _outputs(model, obs)
    assert (changed[-3] - without[-3]).abs().max() > 1e-4  # velocity
    assert (changed[-2] - without[-2]).abs().max() > 1e-4  # video velocity


def test_inference_shortcuts_equal_the_autograd_path(tiny_policy: TinyWAM, tiny_obs: Obs) -> None:
    """Without autograd, LoRA runs as one folded weight and velocity() reuses the action
    expert's context K/V across steps; both must give the autograd path's numbers, and
    follow weight updates (folded weights are re-made when a tensor's version changes)."""
    model, obs = tiny_policy, tiny_obs
    x, sigma = noisy_actions()

    def with_grad() -> tuple[torch.Tensor, torch.Tensor]:
        cache = model.prefill(obs)
        return cache.k[-1].detach(), model.velocity(cache, x, sigma).detach()

    def without_grad() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            cache = model.prefill(obs)
            first = model.velocity(cache, x, sigma)
            assert cache.action_ctx_kv is not None  # kept for the next denoising step
            again = model.velocity(cache, x, sigma)
        assert torch.equal(first, again)
        return cache.k[-1], again

    for _ in range(2):  # after an optimiser-style in-place update too
        for a, b in zip(with_grad(), without_grad(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        with torch.no_grad():
            model.video_blocks[-1].qkv.lora_b.add_(0.2)
            model.action_blocks[0].cross_kv.weight.mul_(1.5)
    cache = model.prefill(obs)
    with torch.no_grad():
        model.velocity(cache, x, sigma)  # fills the no-grad K/V memo...
    v = model.velocity(cache, x, sigma)  # ...which the autograd path must not use
    v.sum().backward()
    assert model.action_blocks[0].cross_kv.weight.grad is not None


def test_parameter_groups(tiny_policy: TinyWAM) -> None:
    model = tiny_policy
    groups = model.parameter_groups()
    assert set(groups) == {"actor", "world_model"}
    actor, wm = groups["actor"], groups["world_model"]
    assert actor and wm
    ids_a, ids_w = {id(p) for p in actor}, {id(p) for p in wm}
    assert len(ids_a) == len(actor) and len(ids_w) == len(wm) and not ids_a & ids_w
    names = {id(p): n for n, p in model.named_parameters()}
    lora_ids = {id(p) for n, p in model.named_parameters() if n.endswith(("lora_a", "lora_b"))}
    assert ids_w == lora_ids  # world model: every LoRA tensor, nothing else
    assert all(names[i].startswith("video_blocks.") for i in ids_w)
    expected_actor = {
        id(p) for n, p in model.named_parameters() if n.startswith(("action_", "proprio_enc"))
    }
    assert ids_a == expected_actor
    assert id(model.action_outp.weight) in ids_a and id(model.proprio_enc[0].weight) in ids_a
    assert not any(names[i].startswith(("video_", "ae.")) for i in ids_a)


# ----------------------------------------------------------------------------- training


def _train(model: TinyWAM, params: list[nn.Parameter], loss_fn, steps: int = 8) -> list[float]:
    keep = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = loss_fn(torch.Generator().manual_seed(0))  # the same flow noise every step
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        losses.append(float(loss_fn(torch.Generator().manual_seed(0))))
    return losses


def test_optimiser_steps_lower_video_and_action_loss() -> None:
    model, obs = make_tiny_policy().eval(), make_obs()
    model.train()
    g = torch.Generator().manual_seed(4)
    video = torch.rand(B, 3, 3, 224, 448, generator=g) * 2 - 1
    actions = torch.rand(B, CHUNK_LEN, ACTION_DIM, generator=g) * 2 - 1
    groups = model.parameter_groups()
    lv = _train(
        model,
        groups["world_model"],
        lambda gen: model.video_loss(video, obs.context, obs.context_mask, obs.proprio, gen),
    )
    la = _train(model, groups["actor"], lambda gen: model.action_loss(obs, actions, gen))
    assert all(np.isfinite(lv)) and all(np.isfinite(la))
    # the video loss includes the autoencoder's reconstruction term, which LoRA cannot move
    assert lv[-1] < lv[0] - 0.05, lv
    assert la[-1] < 0.6 * la[0], la


# ----------------------------------------------------------------------------- imagination


@torch.no_grad()
def test_imagine_shape_range_and_determinism(tiny_policy: TinyWAM, tiny_obs: Obs) -> None:
    model, obs = tiny_policy, tiny_obs
    out = model.imagine(obs, 2, steps=2, generator=torch.Generator().manual_seed(0))
    assert out.shape == (B, 2, 3, 224, 448) and out.dtype == torch.float32
    assert bool(torch.isfinite(out).all())
    assert float(out.min()) >= -1.0 and float(out.max()) <= 1.0
    again = model.imagine(obs, 2, steps=2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    other = model.imagine(obs, 2, steps=2, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(out, other)  # the seed is the only randomness
    with torch.no_grad():  # a decoder driven hard into saturation still stays in [-1, 1]
        model.ae.dec[-1].weight.mul_(100.0)
    sat = model.imagine(obs, 1, steps=1, generator=torch.Generator().manual_seed(0))
    assert sat.shape == (B, 1, 3, 224, 448)
    assert float(sat.abs().max()) > 0.99 and float(sat.min()) >= -1.0 and float(sat.max()) <= 1.0


def test_apply_rope_rotates_each_pair_by_its_angle() -> None:
    from wamrl.policy.tiny import apply_rope, rope_angles, rotation

    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8)
    angles = rope_angles(torch.arange(5), 8)  # [5, 4]: pair i of token n turns by angles[n, i]
    out = apply_rope(x, rotation(angles))
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = angles.cos(), angles.sin()
    torch.testing.assert_close(out[..., 0::2], x1 * c - x2 * s, rtol=0, atol=1e-6)
    torch.testing.assert_close(out[..., 1::2], x1 * s + x2 * c, rtol=0, atol=1e-6)
    torch.testing.assert_close(out[:, :, 0], x[:, :, 0])  # position 0: no rotation
    pair_norm = (out.unflatten(-1, (-1, 2)) ** 2).sum(-1)
    torch.testing.assert_close(pair_norm, (x.unflatten(-1, (-1, 2)) ** 2).sum(-1))
    # relative positions: <R(m) q, R(n) k> depends on m - n only
    q, k = torch.randn(8), torch.randn(8)
    rot = rotation(rope_angles(torch.arange(6), 8))

    def at(v: torch.Tensor, n: int) -> torch.Tensor:
        return apply_rope(v.expand(1, 1, 6, 8), rot)[0, 0, n]

    torch.testing.assert_close(at(q, 3) @ at(k, 1), at(q, 4) @ at(k, 2), rtol=1e-5, atol=1e-5)
