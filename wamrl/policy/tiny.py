"""The `tiny` backend: Fast-WAM's mixture-of-transformers at laptop size.

Structure (docs/design.md "The policy"):
- an image autoencoder of its own, 16x spatial compression: 224x448 -> 14x28 latents,
  2x2 patches -> 98 tokens per frame;
- a video expert and an action expert, `layers` layers each. In every layer each expert
  computes its own q/k/v; the sequences are joined for ONE attention call under Fast-WAM's
  mask; each expert then has its own output projection, text cross-attention and FFN;
- mask: first-frame video sees the first frame; other video sees all video; actions see
  actions and the first frame; video never sees actions. Hence the first-frame K/V cache;
- RoPE: 3D (frame, row, col) on video tokens, 1D on action tokens;
- per-token timesteps: the first frame is clean (sigma = 0), future frames share a sigma;
- proprio is one extra context token of the action expert's cross-attention. It is encoded
  in `velocity`, not in `prefill`, so the actor's gradient reaches the proprio encoder
  (the learner computes the cache under no_grad);
- LoRA (rank from config) on every linear layer of the video expert: the world model's
  only trainable parameters.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wamrl.contract import ACTION_DIM, CHUNK_LEN, PROPRIO_DIM
from wamrl.policy.base import Obs, Policy, generator_device
from wamrl.policy.checkpoint import load_state, read_policy_yaml, save_state, write_policy_yaml
from wamrl.policy.lora import add_lora, lora_parameters

LAT_H, LAT_W = 14, 28  # latent grid (224 x 448 / 16)
TOK_H, TOK_W = 7, 14  # token grid after 2x2 patches
TOKENS_PER_FRAME = TOK_H * TOK_W  # 98
SHIFT = 5.0


@dataclass(frozen=True)
class TinyConfig:
    video_dim: int = 128
    action_dim: int = 64
    layers: int = 4
    heads: int = 4
    head_dim: int = 32
    latent_channels: int = 16
    ffn_mult: int = 4  # FFN hidden = ffn_mult x dim
    text_dim: int = 384
    text_max_len: int = 32
    lora_rank: int = 8


def noise(
    fn, shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """fn (torch.rand / randn) drawn where the generator lives (CPU without one), then on
    `device`. A CUDA generator keeps training free of host-to-device copies, which would
    stall the GPU queue every step."""
    return fn(shape, generator=generator, device=generator_device(generator)).to(device)


def shifted_sigma(u: Tensor, shift: float = SHIFT) -> Tensor:
    return shift * u / (1.0 + (shift - 1.0) * u)


# ----------------------------------------------------------------------------- building blocks


class AutoEncoder(nn.Module):
    """Pixels [-1, 1] [B, 3, 224, 448] <-> latents [B, C, 14, 28] (16x down and up)."""

    def __init__(self, c: int):
        super().__init__()
        w = (16, 32, 64)
        # The encoder runs in every query: an 8x8 patch stem and one 2x2 stage cost ~41
        # MFLOP per image, a sixth of four stride-2 4x4 stages. Decoding runs only in the
        # reward's imagination, so the decoder keeps the smoother four-stage upsampling.
        self.enc = nn.Sequential(
            nn.Conv2d(3, w[2], 8, 8), nn.SiLU(),
            nn.Conv2d(w[2], c, 2, 2),
        )  # fmt: skip
        self.dec = nn.Sequential(
            nn.ConvTranspose2d(c, w[2], 4, 2, 1), nn.SiLU(),
            nn.ConvTranspose2d(w[2], w[1], 4, 2, 1), nn.SiLU(),
            nn.ConvTranspose2d(w[1], w[0], 4, 2, 1), nn.SiLU(),
            nn.ConvTranspose2d(w[0], 3, 4, 2, 1),
        )  # fmt: skip

    def encode(self, img: Tensor) -> Tensor:
        return self.enc(img)

    def decode(self, z: Tensor) -> Tensor:
        return torch.tanh(self.dec(z))


def timestep_embedding(sigma: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of sigma * 1000: [...] -> [..., dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=sigma.device) / half)
    args = sigma.float()[..., None] * 1000.0 * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


def rope_angles(pos: Tensor, dim: int) -> Tensor:
    """pos [N] -> angles [N, dim/2]."""
    freqs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=pos.device).float() / dim))
    return pos.float()[:, None] * freqs[None]


def rotation(angles: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE angles [N, D/2] -> (cos, signed sin), each [N, D] in pair layout: cos of pair i
    at 2i and 2i+1, sin as (-sin, +sin). Computed once per forward, shared by every layer."""
    cos, sin = angles.cos(), angles.sin()
    return cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)


def apply_rope(x: Tensor, rot: tuple[Tensor, Tensor]) -> Tensor:
    """x [B, H, N, D]: rotate each consecutive pair (x1, x2) by its angle, i.e.
    (x1 cos - x2 sin, x1 sin + x2 cos) = x * cos + swap(x) * (-sin, sin), swap(x) = (x2, x1).
    Four kernels (seven for the pairwise form); the same products and sums, so the same bits.
    (This runs ~500 times per full-size query, where kernel count, not FLOPs, sets latency.)"""
    cos, signed_sin = rot
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos + swapped * signed_sin


def video_rope(frames: int, head_dim: int, device: torch.device) -> Tensor:
    """3D RoPE angles for `frames` x 7 x 14 tokens: [frames * 98, head_dim / 2]."""
    d_hw = (head_dim // 3) // 2 * 2
    d_t = head_dim - 2 * d_hw
    t, r, c = torch.meshgrid(
        torch.arange(frames, device=device),
        torch.arange(TOK_H, device=device),
        torch.arange(TOK_W, device=device),
        indexing="ij",
    )
    return torch.cat(
        [
            rope_angles(t.flatten(), d_t),
            rope_angles(r.flatten(), d_hw),
            rope_angles(c.flatten(), d_hw),
        ],
        -1,
    )


class ExpertBlock(nn.Module):
    """One expert's half of a layer: its q/k/v, output projection, text cross-attention, FFN."""

    def __init__(self, dim: int, heads: int, head_dim: int, ctx_dim: int, ffn_mult: int):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * inner)
        self.out = nn.Linear(inner, dim)
        self.norm_x = nn.LayerNorm(dim)
        self.cross_q = nn.Linear(dim, inner)
        self.cross_kv = nn.Linear(ctx_dim, 2 * inner)
        self.cross_out = nn.Linear(inner, dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = ffn_mult * dim
        self.ffn = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def split(self, t: Tensor) -> Tensor:  # [B, N, H*D] -> [B, H, N, D]
        b, n, _ = t.shape
        return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

    def qkv_heads(self, x: Tensor, rot: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, -1)
        return apply_rope(self.split(q), rot), apply_rope(self.split(k), rot), self.split(v)

    def context_kv(self, ctx: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.cross_kv(ctx).chunk(2, -1)
        return self.split(k), self.split(v)

    def finish(
        self,
        x: Tensor,
        attn: Tensor,
        ctx: Tensor | tuple[Tensor, Tensor],
        ctx_mask: Tensor,
    ) -> Tensor:
        """Residual after the joint attention, then cross-attention to the context (raw
        tokens, or their K/V from context_kv), then FFN."""
        b, _, n, _ = attn.shape
        x = x + self.out(attn.transpose(1, 2).reshape(b, n, -1))
        q = self.split(self.cross_q(self.norm_x(x)))
        k, v = self.context_kv(ctx) if isinstance(ctx, Tensor) else ctx
        c = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx_mask[:, None, None, :])
        x = x + self.cross_out(c.transpose(1, 2).reshape(b, n, -1))
        return x + self.ffn(self.norm2(x))


@dataclass
class Cache:
    """First-frame K/V of every layer (post-RoPE) plus what the action expert conditions on."""

    k: list[Tensor]  # per layer [B, H, 98, D]
    v: list[Tensor]
    context: Tensor  # [B, L, Dc]
    context_mask: Tensor  # [B, L]
    proprio: Tensor  # [B, 8]
    # The action expert's cross-attention K/V of context + proprio token, per layer. They
    # are the same at every denoising step; velocity() fills this in only without autograd
    # (the rollout), so the actor's gradient still reaches cross_kv and the proprio encoder.
    action_ctx_kv: list[tuple[Tensor, Tensor]] | None = None
    action_rot: tuple[Tensor, Tensor] | None = None  # the action tokens' RoPE (constant)


# ----------------------------------------------------------------------------- the model


class TinyWAM(Policy):
    backend = "tiny"

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        c, dv, da = cfg.latent_channels, cfg.video_dim, cfg.action_dim
        self.ae = AutoEncoder(c)
        # video expert
        self.video_in = nn.Linear(4 * c, dv)
        self.video_time = nn.Sequential(nn.Linear(64, dv), nn.SiLU(), nn.Linear(dv, dv))
        self.video_blocks = nn.ModuleList(
            ExpertBlock(dv, cfg.heads, cfg.head_dim, cfg.text_dim, cfg.ffn_mult)
            for _ in range(cfg.layers)
        )
        self.video_norm = nn.LayerNorm(dv)
        self.video_outp = nn.Linear(dv, 4 * c)
        # action expert (+ proprio encoder: one extra context token)
        self.action_in = nn.Linear(ACTION_DIM, da)
        self.action_time = nn.Sequential(nn.Linear(64, da), nn.SiLU(), nn.Linear(da, da))
        self.action_pos = nn.Parameter(torch.zeros(CHUNK_LEN, da))
        self.action_blocks = nn.ModuleList(
            ExpertBlock(da, cfg.heads, cfg.head_dim, cfg.text_dim, cfg.ffn_mult)
            for _ in range(cfg.layers)
        )
        self.action_norm = nn.LayerNorm(da)
        self.action_outp = nn.Linear(da, ACTION_DIM)
        self.proprio_enc = nn.Sequential(
            nn.Linear(PROPRIO_DIM, cfg.text_dim), nn.SiLU(), nn.Linear(cfg.text_dim, cfg.text_dim)
        )
        for blk in self.video_blocks:
            add_lora(blk, cfg.lora_rank)

    # --- tokens ---------------------------------------------------------------------------
    @staticmethod
    def patchify(z: Tensor) -> Tensor:
        """[B, F, C, 14, 28] -> [B, F*98, 4C]."""
        b, f, c, _, _ = z.shape
        z = z.view(b, f, c, TOK_H, 2, TOK_W, 2).permute(0, 1, 3, 5, 2, 4, 6)
        return z.reshape(b, f * TOKENS_PER_FRAME, 4 * c)

    def unpatchify(self, t: Tensor, frames: int) -> Tensor:
        b, c = t.shape[0], self.cfg.latent_channels
        t = t.view(b, frames, TOK_H, TOK_W, c, 2, 2).permute(0, 1, 4, 2, 5, 3, 6)
        return t.reshape(b, frames, c, LAT_H, LAT_W)

    def encode_frames(self, video: Tensor) -> Tensor:
        """[B, F, 3, 224, 448] -> latents [B, F, C, 14, 28]."""
        b, f = video.shape[:2]
        return self.ae.encode(video.flatten(0, 1)).view(
            b, f, self.cfg.latent_channels, LAT_H, LAT_W
        )

    def video_tokens(self, z: Tensor, sigma_frames: Tensor) -> Tensor:
        """latents [B, F, C, 14, 28], per-frame sigma [B, F] -> tokens [B, F*98, Dv]."""
        x = self.video_in(self.patchify(z))
        temb = self.video_time(timestep_embedding(sigma_frames, 64))  # [B, F, Dv]
        return x + temb.repeat_interleave(TOKENS_PER_FRAME, dim=1)

    def action_tokens(self, x: Tensor, sigma: Tensor) -> Tensor:
        temb = self.action_time(timestep_embedding(sigma, 64))[:, None]
        return self.action_in(x) + self.action_pos + temb

    def action_context(
        self, context: Tensor, mask: Tensor, proprio: Tensor
    ) -> tuple[Tensor, Tensor]:
        tok = self.proprio_enc(proprio)[:, None]
        ones = torch.ones_like(mask[:, :1])
        return torch.cat([context, tok], 1), torch.cat([mask, ones], 1)

    # --- the joint forward (reference; training and tests) -------------------------------
    def joint_forward(
        self,
        z: Tensor | None,
        sigma_frames: Tensor | None,
        x: Tensor | None,
        sigma_action: Tensor | None,
        context: Tensor,
        context_mask: Tensor,
        proprio: Tensor,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Both experts, one masked attention per layer. Returns (video velocity latents,
        action velocity, last video hidden states); parts are None where inputs are None."""
        dev = context.device
        hv = ha = None
        nv = na = 0
        frames = 0
        if z is not None:
            frames = z.shape[1]
            hv = self.video_tokens(z, sigma_frames)
            nv = hv.shape[1]
            ang_v = rotation(video_rope(frames, self.cfg.head_dim, dev))
        if x is not None:
            ha = self.action_tokens(x, sigma_action)
            na = CHUNK_LEN
            ang_a = rotation(rope_angles(torch.arange(CHUNK_LEN, device=dev), self.cfg.head_dim))
            actx, amask = self.action_context(context, context_mask, proprio)
        mask = fastwam_mask(nv, na, dev)
        for vb, ab in zip(self.video_blocks, self.action_blocks, strict=True):
            qs, ks, vs = [], [], []
            if hv is not None:
                for lst, t in zip((qs, ks, vs), vb.qkv_heads(hv, ang_v), strict=True):
                    lst.append(t)
            if ha is not None:
                for lst, t in zip((qs, ks, vs), ab.qkv_heads(ha, ang_a), strict=True):
                    lst.append(t)
            att = F.scaled_dot_product_attention(
                torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask
            )
            if hv is not None:
                hv = vb.finish(hv, att[:, :, :nv], context, context_mask)
            if ha is not None:
                ha = ab.finish(ha, att[:, :, nv:], actx, amask)
        vel_v = feats = vel_a = None
        if hv is not None:
            feats = hv
            vel_v = self.unpatchify(self.video_outp(self.video_norm(hv)), frames)
        if ha is not None:
            vel_a = self.action_outp(self.action_norm(ha))
        return vel_v, vel_a, feats

    # --- the Policy interface ------------------------------------------------------------
    def prefill(self, obs: Obs) -> Cache:
        z = self.ae.encode(obs.image)[:, None]  # [B, 1, C, 14, 28]
        b = z.shape[0]
        h = self.video_tokens(z, torch.zeros(b, 1, device=z.device))
        ang = rotation(video_rope(1, self.cfg.head_dim, z.device))
        ks, vs = [], []
        for vb in self.video_blocks:
            q, k, v = vb.qkv_heads(h, ang)
            ks.append(k)
            vs.append(v)
            att = F.scaled_dot_product_attention(q, k, v)  # first frame sees only itself
            h = vb.finish(h, att, obs.context, obs.context_mask)
        return Cache(ks, vs, obs.context, obs.context_mask, obs.proprio)

    def velocity(self, cache: Cache, x: Tensor, sigma: Tensor) -> Tensor:
        ha = self.action_tokens(x, sigma.expand(x.shape[0]))
        if cache.action_rot is None:  # the same at every step: no parameters in it
            pos = torch.arange(CHUNK_LEN, device=x.device)
            cache.action_rot = rotation(rope_angles(pos, self.cfg.head_dim))
        ang = cache.action_rot
        actx, amask = self.action_context(cache.context, cache.context_mask, cache.proprio)
        if torch.is_grad_enabled():
            ctx_kv = [ab.context_kv(actx) for ab in self.action_blocks]
        else:
            if cache.action_ctx_kv is None:
                cache.action_ctx_kv = [ab.context_kv(actx) for ab in self.action_blocks]
            ctx_kv = cache.action_ctx_kv
        for layer, ab in enumerate(self.action_blocks):
            q, k, v = ab.qkv_heads(ha, ang)
            k = torch.cat([cache.k[layer], k], 2)
            v = torch.cat([cache.v[layer], v], 2)
            att = F.scaled_dot_product_attention(q, k, v)  # actions see first frame + actions
            ha = ab.finish(ha, att, ctx_kv[layer], amask)
        return self.action_outp(self.action_norm(ha))

    def imagine(
        self, obs: Obs, num_future: int, steps: int, generator: torch.Generator | None = None
    ) -> Tensor:
        z0 = self.ae.encode(obs.image)[:, None]
        b = z0.shape[0]
        shape = (b, num_future, *z0.shape[2:])
        zf = noise(torch.randn, shape, generator, z0.device)
        u = 1.0 - torch.arange(steps + 1, dtype=torch.float64) / steps
        sig = shifted_sigma(u).float().tolist()
        for k in range(steps):
            sf = torch.cat([torch.zeros(b, 1), torch.full((b, num_future), sig[k])], 1).to(
                z0.device
            )
            vel, _, _ = self.joint_forward(
                torch.cat([z0, zf], 1), sf, None, None, obs.context, obs.context_mask, obs.proprio
            )
            zf = zf + (sig[k + 1] - sig[k]) * vel[:, 1:]
        out = self.ae.decode(zf.flatten(0, 1))
        return out.view(b, num_future, *out.shape[1:])

    def video_loss(
        self,
        video: Tensor,
        context: Tensor,
        context_mask: Tensor,
        proprio: Tensor,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        # The flow loss runs on detached latents (else the encoder could shrink them and make
        # the flow trivially easy); the autoencoder learns from its own reconstruction term,
        # so imagined latents decode to pixels that the reconstruction reward can compare.
        b, f = video.shape[:2]
        z = self.encode_frames(video)
        recon = F.mse_loss(self.ae.decode(z.flatten(0, 1)), video.flatten(0, 1))
        z = z.detach()
        sigma = shifted_sigma(noise(torch.rand, (b,), generator, z.device))
        eps = noise(torch.randn, z[:, 1:].shape, generator, z.device)
        s = sigma[:, None, None, None, None]
        noisy = torch.cat([z[:, :1], (1 - s) * z[:, 1:] + s * eps], 1)
        sf = torch.cat([torch.zeros(b, 1, device=z.device), sigma[:, None].expand(b, f - 1)], 1)
        vel, _, _ = self.joint_forward(noisy, sf, None, None, context, context_mask, proprio)
        return F.mse_loss(vel[:, 1:], eps - z[:, 1:]) + recon

    def action_loss(
        self, obs: Obs, actions: Tensor, generator: torch.Generator | None = None
    ) -> Tensor:
        b = actions.shape[0]
        sigma = shifted_sigma(noise(torch.rand, (b,), generator, actions.device))
        eps = noise(torch.randn, actions.shape, generator, actions.device)
        s = sigma[:, None, None]
        v = self.velocity(self.prefill(obs), (1 - s) * actions + s * eps, sigma)
        return F.mse_loss(v, eps - actions)

    def features(
        self, video: Tensor, context: Tensor, context_mask: Tensor, proprio: Tensor
    ) -> Tensor:
        z = self.encode_frames(video)
        sf = torch.zeros(z.shape[:2], device=z.device)
        _, _, feats = self.joint_forward(z, sf, None, None, context, context_mask, proprio)
        return feats

    def compile_layers(self) -> bool:
        # Per block, not the whole query: one compiled graph serves all layers of an expert
        # (dynamic shapes: every batch size), so compiling takes seconds, not minutes.
        for blk in [*self.video_blocks, *self.action_blocks]:
            blk.qkv_heads = torch.compile(blk.qkv_heads, dynamic=True)
            blk.finish = torch.compile(blk.finish, dynamic=True)
        return True

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        actor = [p for n, p in self.named_parameters() if n.startswith(("action_", "proprio_enc"))]
        return {"actor": actor, "world_model": lora_parameters(self.video_blocks)}

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_state(self.state_dict(), directory / "model.safetensors")
        write_policy_yaml(directory / "policy.yaml", self.backend, asdict(self.cfg))

    @classmethod
    def load(cls, directory: Path, device: str | torch.device = "cpu") -> TinyWAM:
        directory = Path(directory)
        meta = read_policy_yaml(directory / "policy.yaml", cls.backend)
        try:
            cfg = TinyConfig(**meta["config"])
        except TypeError as e:
            raise ValueError(f"{directory / 'policy.yaml'}: bad tiny config: {e}") from e
        model = cls(cfg)
        load_state(model, directory / "model.safetensors")
        return model.to(device)


def fastwam_mask(nv: int, na: int, device: torch.device) -> Tensor:
    """Boolean [nv + na, nv + na], True = may attend. Video = first frame + future frames."""
    n = nv + na
    first = min(TOKENS_PER_FRAME, nv)
    m = torch.zeros(n, n, dtype=torch.bool, device=device)
    m[:first, :first] = True  # first frame sees the first frame
    m[first:nv, :nv] = True  # other video sees all video
    m[nv:, nv:] = True  # actions see actions
    m[nv:, :first] = True  # ... and the first frame; video never sees actions
    return m


def build_tiny(cfg: dict[str, Any]) -> TinyWAM:
    t = cfg["policy"]["tiny"]
    return TinyWAM(
        TinyConfig(
            video_dim=t["video_dim"],
            action_dim=t["action_dim"],
            layers=t["layers"],
            heads=t["heads"],
            head_dim=t["head_dim"],
            latent_channels=t["latent_channels"],
            ffn_mult=t["ffn_mult"],
            text_max_len=t["text_max_len"],
            lora_rank=cfg["world_model"]["lora_rank"],
        )
    )
