"""The `fastwam` backend: the official Fast-WAM model and checkpoint behind wamrl's Policy.

The official package (import name `fastwam`, https://github.com/yuantianyuan01/FastWAM) is an
optional dependency, imported at run time; nothing of it is vendored here. What this adapter
maps onto the interface (docs/design.md "The policy"):

- prefill   = VAE-encode the current image (first latent frame), append the proprio token to
              the umT5 context, run the video expert's `pre_dit` at timestep 0 and
              `MoT.prefill_video_cache` under the joint mask of `FastWAM._build_mot_attention_mask`
              (the steps `FastWAM.infer_action` takes before its denoising loop);
- velocity  = `ActionDiT.pre_dit` -> `MoT.forward_action_with_video_cache` -> `ActionDiT.post_dit`
              at timestep = sigma * num_train_timesteps (the body of one `infer_action` step,
              without its no_grad, so the actor's gradient reaches the action expert and the
              proprio encoder: the proprio token is re-encoded here from the cached proprio);
- imagine   = the video half of `FastWAM.infer_joint`: noise latents with the clean first
              frame pinned, the official video scheduler's ODE steps, VAE decode. Video tokens
              never attend to action tokens, so the video expert runs alone;
- losses    = the official training targets (eps - x0, shifted-sigma sampling, the schedulers'
              training weights), video loss over the future latent frames only;
- LoRA      = wamrl.policy.lora on every linear layer of the video expert's blocks, added after
              the release weights are loaded (B = 0: the output is unchanged bit for bit).

A policy directory holds only what RL changes (model.safetensors: the action expert, the
proprio encoder and the LoRA tensors, names as in state_dict()) plus policy.yaml, whose
config names the release checkpoint and VAE files the rest is rebuilt from.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wamrl.contract import ACTION_DIM, CHUNK_LEN, PROPRIO_DIM
from wamrl.policy.base import Obs, Policy, generator_device
from wamrl.policy.checkpoint import read_policy_yaml, write_policy_yaml
from wamrl.policy.lora import add_lora, lora_parameters

INSTALL_HINT = (
    "the `fastwam` policy backend needs the official Fast-WAM package (import name `fastwam`), "
    "which wamrl does not install: `git clone https://github.com/yuantianyuan01/FastWAM && "
    "pip install --no-deps -e FastWAM && pip install einops omegaconf` (its model code needs "
    "torch, einops, omegaconf, rich, tqdm, safetensors, transformers; its pinned CUDA wheels "
    "are not required). Or use `policy.backend: tiny`."
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The prompt template of the Fast-WAM LIBERO data and eval (fastwam.datasets.lerobot.
# robot_video_dataset.DEFAULT_PROMPT); wamrl/policy/context.py takes it from the package itself.
PROMPT_FALLBACK = (
    "A video recorded from a robot's point of view executing the following instruction: {task}"
)


def import_fastwam() -> SimpleNamespace:
    """The official classes this adapter uses; a clear ImportError when the package is absent."""
    try:
        from fastwam.models.wan22.action_dit import ActionDiT
        from fastwam.models.wan22.fastwam import FastWAM
        from fastwam.models.wan22.mot import MoT
        from fastwam.models.wan22.wan_video_dit import WanVideoDiT
        from fastwam.models.wan22.wan_video_vae import VideoVAE38_, WanVideoVAE38
    except ImportError as e:  # the package, or one of its own imports (einops, ...)
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e
    return SimpleNamespace(
        FastWAM=FastWAM,
        ActionDiT=ActionDiT,
        MoT=MoT,
        WanVideoDiT=WanVideoDiT,
        WanVideoVAE38=WanVideoVAE38,
        VideoVAE38_=VideoVAE38_,
    )


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class FastWAMArch:
    """Sizes of the official model (configs/model/fastwam.yaml of the release)."""

    video_hidden_dim: int = 3072
    video_ffn_dim: int = 14336
    action_hidden_dim: int = 1024
    action_ffn_dim: int = 4096
    num_heads: int = 24
    head_dim: int = 128
    num_layers: int = 30
    text_dim: int = 4096
    latent_channels: int = 48
    freq_dim: int = 256
    eps: float = 1e-6


@dataclass(frozen=True)
class FastWAMConfig:
    checkpoint: str  # the release's .pt ({"mot": state_dict, "proprio_encoder": state_dict})
    vae: str  # Wan2.2_VAE (.safetensors or .pth)
    text_encoder: str | None = (
        None  # umT5-xxl encoder weights; only wamrl/policy/context.py reads it
    )
    tokenizer: str | None = (
        None  # google/umt5-xxl tokenizer directory; only wamrl/policy/context.py
    )
    dtype: str = "bfloat16"
    context_len: int = 128
    imagine_latent_frames: int = 3  # 1 + (33 - 1) / 4 / 4: the training window's latent frames
    shift: float = 5.0  # the schedulers' infer/train shift (sampler.shift must agree)
    num_train_timesteps: int = 1000
    gradient_checkpointing: bool = False
    lora_rank: int = 64
    arch: FastWAMArch = field(default_factory=FastWAMArch)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "policy.fastwam") -> FastWAMConfig:
        d = dict(d)
        known = {f.name for f in fields(cls)}
        extra = sorted(set(d) - known)
        if extra:
            raise ValueError(f"{where}: unknown keys {extra}")
        arch = d.pop("arch", None) or {}
        try:
            return cls(**d, arch=FastWAMArch(**arch))
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from e

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ValueError(f"policy.fastwam.dtype: {self.dtype!r} not in {sorted(DTYPES)}")
        return DTYPES[self.dtype]


def config_from_run(cfg: dict[str, Any]) -> FastWAMConfig:
    """The backend config from a resolved wamrl config (paths resolved against the repo)."""
    from wamrl.config import resolve_path

    f = dict(cfg["policy"]["fastwam"])
    for key in ("checkpoint", "vae", "text_encoder", "tokenizer"):
        if f.get(key) is not None:
            f[key] = str(resolve_path(f[key]))
    f["lora_rank"] = int(cfg["world_model"]["lora_rank"])
    return FastWAMConfig.from_dict(f)


def video_dit_config(a: FastWAMArch, gradient_checkpointing: bool = False) -> dict[str, Any]:
    return {
        "has_image_input": False,
        "patch_size": [1, 2, 2],
        "in_dim": a.latent_channels,
        "hidden_dim": a.video_hidden_dim,
        "ffn_dim": a.video_ffn_dim,
        "freq_dim": a.freq_dim,
        "text_dim": a.text_dim,
        "out_dim": a.latent_channels,
        "num_heads": a.num_heads,
        "attn_head_dim": a.head_dim,
        "num_layers": a.num_layers,
        "eps": a.eps,
        "seperated_timestep": True,
        "require_clip_embedding": False,
        "require_vae_embedding": False,
        "fuse_vae_embedding_in_latents": True,
        "use_gradient_checkpointing": gradient_checkpointing,
        "video_attention_mask_mode": "first_frame_causal",
        "action_conditioned": False,
        "action_dim": ACTION_DIM,
        "action_group_causal_mask_mode": "group_diagonal",
    }


def action_dit_config(a: FastWAMArch, gradient_checkpointing: bool = False) -> dict[str, Any]:
    return {
        "action_dim": ACTION_DIM,
        "hidden_dim": a.action_hidden_dim,
        "ffn_dim": a.action_ffn_dim,
        "num_heads": a.num_heads,
        "attn_head_dim": a.head_dim,
        "num_layers": a.num_layers,
        "text_dim": a.text_dim,
        "freq_dim": a.freq_dim,
        "eps": a.eps,
        "use_gradient_checkpointing": gradient_checkpointing,
    }


# ----------------------------------------------------------------------------- files


def check_file(path: str | Path | None, what: str) -> Path:
    if path is None:
        raise FileNotFoundError(f"policy.fastwam.{what}: not set")
    p = Path(path)
    if not p.is_file() and not (what == "tokenizer" and p.is_dir()):
        raise FileNotFoundError(f"policy.fastwam.{what}: file not found: {p}")
    return p


def _read_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a .safetensors (header only) or torch zip file (memory-mapped)."""
    if path.suffix == ".safetensors":
        from wamrl.artifact import tensor_header

        return tensor_header(path)[0]
    state = _torch_load(path)
    return {k: tuple(v.shape) for k, v in _flatten(state).items()}


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # not a zip archive: no mmap
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path}: cannot read as a torch checkpoint: {e}") from e


def _flatten(state: Any, prefix: str = "") -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_flatten(v, f"{prefix}{k}." if not torch.is_tensor(v) else f"{prefix}{k}"))
    elif torch.is_tensor(state):
        out[prefix.rstrip(".")] = state
    return out


def _compare(path: Path, got: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]):
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    if missing or unexpected:
        raise ValueError(
            f"{path}: does not match the configured Fast-WAM model: missing tensors "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected tensors "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    for k in sorted(want):
        if tuple(got[k]) != tuple(want[k]):
            raise ValueError(
                f"{path}: tensor {k} has shape {tuple(got[k])}, the configured model expects "
                f"{tuple(want[k])} (policy.fastwam.arch)"
            )


def _vae_key(k: str) -> str:
    """The official converter: unwrap `model_state`, prefix `model.`."""
    return "model." + (k[len("model_state.") :] if k.startswith("model_state.") else k)


def check_release_files(cfg: FastWAMConfig) -> dict[str, Any]:
    """Existence and tensor names/shapes of the checkpoint and VAE, before any weights are
    allocated (the expected shapes come from the official classes built on the meta device)."""
    ckpt = check_file(cfg.checkpoint, "checkpoint")
    vae = check_file(cfg.vae, "vae")
    ns = import_fastwam()
    payload = _torch_load(ckpt)
    if not isinstance(payload, dict) or "mot" not in payload:
        raise ValueError(
            f"{ckpt}: not a Fast-WAM release checkpoint (expected a dict with key 'mot')"
        )
    if "proprio_encoder" not in payload:
        raise ValueError(f"{ckpt}: has no 'proprio_encoder' weights (proprio_dim = 8 expected)")
    with torch.device("meta"):
        video = ns.WanVideoDiT(**video_dit_config(cfg.arch))
        action = ns.ActionDiT(**action_dit_config(cfg.arch))
        mot = ns.MoT({"video": video, "action": action}, mot_checkpoint_mixed_attn=False)
        vae_model = _new_vae(cfg)
    want = {k: tuple(v.shape) for k, v in mot.state_dict().items()}
    _compare(ckpt, {k: tuple(v.shape) for k, v in payload["mot"].items()}, want)
    prop = {k: tuple(v.shape) for k, v in payload["proprio_encoder"].items()}
    _compare(
        ckpt,
        {f"proprio_encoder.{k}": s for k, s in prop.items()},
        {
            "proprio_encoder.weight": (cfg.arch.text_dim, PROPRIO_DIM),
            "proprio_encoder.bias": (cfg.arch.text_dim,),
        },
    )
    vae_shapes = {_vae_key(k): s for k, s in _read_tensor_shapes(vae).items()}
    _compare(vae, vae_shapes, {k: tuple(v.shape) for k, v in vae_model.state_dict().items()})
    return payload


def _new_vae(cfg: FastWAMConfig) -> nn.Module:
    """The Wan2.2 VAE (its architecture is fixed by the release; tests substitute a small one)."""
    return import_fastwam().WanVideoVAE38(z_dim=cfg.arch.latent_channels)


def _load_vae_weights(vae: nn.Module, path: Path) -> None:
    from wamrl.artifact import load_tensors

    raw = (
        load_tensors(path, "VAE") if path.suffix == ".safetensors" else _flatten(_torch_load(path))
    )
    state = {_vae_key(k): v for k, v in raw.items()}
    _compare(path, {k: tuple(v.shape) for k, v in state.items()}, _shapes(vae))
    vae.load_state_dict(state, strict=True)


def _shapes(m: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_official(
    cfg: FastWAMConfig, device: str | torch.device = "cpu", vae: nn.Module | None = None
) -> nn.Module:
    """An official `FastWAM` with randomly initialised experts (weights are loaded after)."""
    ns = import_fastwam()
    dtype = cfg.torch_dtype
    gc = cfg.gradient_checkpointing
    with torch.device(device), _default_dtype(dtype):  # allocate in place, no fp32 detour
        video = ns.WanVideoDiT(**video_dit_config(cfg.arch, gc))
        action = ns.ActionDiT(**action_dit_config(cfg.arch, gc))
    mot = ns.MoT({"video": video, "action": action}, mot_checkpoint_mixed_attn=gc)
    if vae is None:
        vae = _new_vae(cfg)
    return ns.FastWAM(
        video_expert=video,
        action_expert=action,
        mot=mot,
        vae=vae.to(device=device, dtype=dtype),
        text_dim=cfg.arch.text_dim,
        proprio_dim=PROPRIO_DIM,
        device=str(device),
        torch_dtype=dtype,
        video_train_shift=cfg.shift,
        video_infer_shift=cfg.shift,
        video_num_train_timesteps=cfg.num_train_timesteps,
        action_train_shift=cfg.shift,
        action_infer_shift=cfg.shift,
        action_num_train_timesteps=cfg.num_train_timesteps,
    )


def load_release(model: nn.Module, payload: dict[str, Any], path: Path) -> None:
    """The release checkpoint into an official model, strictly (the official loader is not)."""
    want = _shapes(model.mot)
    _compare(path, {k: tuple(v.shape) for k, v in payload["mot"].items()}, want)
    model.mot.load_state_dict(payload["mot"], strict=True)
    model.proprio_encoder.load_state_dict(payload["proprio_encoder"], strict=True)


# ----------------------------------------------------------------------------- the adapter


@dataclass
class FastWAMCache:
    kv: list[dict[str, Tensor]]  # per layer {"k", "v"}: [B, Sv, H * Dh] (post norm + RoPE)
    attention_mask: Tensor  # [Sv + 32, Sv + 32] bool, the official joint mask
    video_seq_len: int
    context: Tensor  # [B, L, text_dim] text only (model dtype)
    context_mask: Tensor  # [B, L] bool
    proprio: Tensor  # [B, 8] (model dtype)


class FastWAMPolicy(Policy):
    backend = "fastwam"

    def __init__(self, model: nn.Module, cfg: FastWAMConfig):
        super().__init__()
        self.cfg = cfg
        self.model = model
        dtype = next(model.video_expert.parameters()).dtype
        add_lora(model.video_expert.blocks, cfg.lora_rank)
        model.video_expert.blocks.to(dtype=dtype)
        self._sync_device()

    # --- device / dtype bookkeeping of the official object (it keeps .device itself) ------
    def _sync_device(self) -> None:
        p = next(self.model.action_expert.parameters())
        self.model.device = p.device
        self.model.torch_dtype = p.dtype

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if "model" in self._modules:
            self._sync_device()
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.model.torch_dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    # --- pieces ----------------------------------------------------------------------------
    def encode_video(self, video: Tensor) -> Tensor:
        """[B, F, 3, H, W] in [-1, 1] (F = 4k + 1) -> latents [B, C, 1 + k, H/16, W/16]."""
        if (video.shape[1] - 1) % 4:
            raise ValueError(f"video needs 4k + 1 frames (VAE time stride 4), got {video.shape[1]}")
        vids = [v.transpose(0, 1).to(self.device, self.dtype) for v in video]  # [3, F, H, W]
        with torch.no_grad():
            return self.model.vae.encode(vids, device=self.device)

    def encode_image(self, image: Tensor) -> Tensor:
        """[B, 3, H, W] -> first-frame latents [B, C, 1, H/16, W/16] (infer_action's encode)."""
        return self.encode_video(image[:, None])

    def _context(self, context: Tensor, mask: Tensor, proprio: Tensor) -> tuple[Tensor, Tensor]:
        ctx = context.to(self.device, self.dtype)
        return self.model._append_proprio_to_context(
            ctx, mask.to(self.device, torch.bool), proprio.to(self.device, self.dtype)
        )

    def _timestep(self, sigma: Tensor, batch: int) -> Tensor:
        t = sigma.to(self.device, torch.float32) * float(self.cfg.num_train_timesteps)
        return t.reshape(-1).expand(batch).to(self.dtype)

    def _video_blocks(self, pre: dict[str, Any]) -> Tensor:
        """The video expert's blocks under its first-frame-causal mask: last hidden states."""
        ve = self.model.video_expert
        x = pre["tokens"]
        mask = ve.build_video_to_video_mask(
            video_seq_len=x.shape[1],
            video_tokens_per_frame=int(pre["meta"]["tokens_per_frame"]),
            device=x.device,
        )
        for block in ve.blocks:
            x = block(
                x, pre["context"], pre["t_mod"], pre["freqs"],
                context_mask=pre["context_mask"], self_attn_mask=mask,
            )  # fmt: skip
        return x

    def _video_velocity(self, z: Tensor, t: Tensor, ctx: Tensor, cmask: Tensor) -> Tensor:
        pre = self.model.video_expert.pre_dit(
            x=z, timestep=t, context=ctx, context_mask=cmask, action=None,
            fuse_vae_embedding_in_latents=True,
        )  # fmt: skip
        return self.model.video_expert.post_dit(self._video_blocks(pre), pre)

    # --- the Policy interface ------------------------------------------------------------
    def prefill(self, obs: Obs) -> FastWAMCache:
        b = obs.batch_size
        z0 = self.encode_image(obs.image)
        ctx, cmask = self._context(obs.context, obs.context_mask, obs.proprio)
        pre = self.model.video_expert.pre_dit(
            x=z0, timestep=torch.zeros(b, dtype=z0.dtype, device=self.device),
            context=ctx, context_mask=cmask, action=None, fuse_vae_embedding_in_latents=True,
        )  # fmt: skip
        sv = int(pre["tokens"].shape[1])
        mask = self.model._build_mot_attention_mask(
            video_seq_len=sv,
            action_seq_len=CHUNK_LEN,
            video_tokens_per_frame=int(pre["meta"]["tokens_per_frame"]),
            device=pre["tokens"].device,
        )
        kv = self.model.mot.prefill_video_cache(
            video_tokens=pre["tokens"],
            video_freqs=pre["freqs"],
            video_t_mod=pre["t_mod"],
            video_context_payload={"context": pre["context"], "mask": pre["context_mask"]},
            video_attention_mask=mask[:sv, :sv],
        )
        return FastWAMCache(
            kv=kv,
            attention_mask=mask,
            video_seq_len=sv,
            context=obs.context.to(self.device, self.dtype),
            context_mask=obs.context_mask.to(self.device, torch.bool),
            proprio=obs.proprio.to(self.device, self.dtype),
        )

    def velocity(self, cache: FastWAMCache, x: Tensor, sigma: Tensor) -> Tensor:
        b = x.shape[0]
        ctx, cmask = self._context(cache.context, cache.context_mask, cache.proprio)
        ae = self.model.action_expert
        pre = ae.pre_dit(
            action_tokens=x.to(self.device, self.dtype),
            timestep=self._timestep(sigma, b),
            context=ctx,
            context_mask=cmask,
        )
        tokens = self.model.mot.forward_action_with_video_cache(
            action_tokens=pre["tokens"],
            action_freqs=pre["freqs"],
            action_t_mod=pre["t_mod"],
            action_context_payload={"context": pre["context"], "mask": pre["context_mask"]},
            video_kv_cache=cache.kv,
            attention_mask=cache.attention_mask,
            video_seq_len=cache.video_seq_len,
        )
        return ae.post_dit(tokens, pre)

    def imagine(
        self, obs: Obs, num_future: int, steps: int, generator: torch.Generator | None = None
    ) -> Tensor:
        frames = max(self.cfg.imagine_latent_frames, 1 + math.ceil(num_future / 4))
        b = obs.batch_size
        z0 = self.encode_image(obs.image)
        c, h, w = z0.shape[1], z0.shape[3], z0.shape[4]
        lat = torch.randn(
            (b, c, frames, h, w), generator=generator, device=generator_device(generator)
        )
        lat = lat.to(self.device, self.dtype)
        lat[:, :, 0:1] = z0
        ctx, cmask = self._context(obs.context, obs.context_mask, obs.proprio)
        sched = self.model.infer_video_scheduler
        ts, deltas = sched.build_inference_schedule(
            num_inference_steps=steps, device=self.device, dtype=lat.dtype
        )
        for t, d in zip(ts, deltas, strict=True):
            v = self._video_velocity(lat, t.reshape(1).expand(b), ctx, cmask)
            lat = sched.step(v, d, lat)
            lat[:, :, 0:1] = z0
        video = self.model.vae.decode(lat, device=self.device).float().clamp(-1, 1)
        # decoded video frame j is env step +4j (video frames are every 4th env step)
        return video[:, :, 1 : 1 + num_future].transpose(1, 2).to(obs.image.device)

    def video_loss(
        self,
        video: Tensor,
        context: Tensor,
        context_mask: Tensor,
        proprio: Tensor,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        z = self.encode_video(video)
        b = z.shape[0]
        sched = self.model.train_video_scheduler
        u = torch.rand(b, generator=generator, device=generator_device(generator))
        t = (sched._phi(u, sched.shift) * float(sched.num_train_timesteps)).to(self.device)
        noise = torch.randn(z.shape, generator=generator, device=generator_device(generator))
        noise = noise.to(self.device, self.dtype)
        noisy = sched.add_noise(z, noise, t.to(self.dtype))
        noisy[:, :, 0:1] = z[:, :, 0:1]
        target = sched.training_target(z, noise, t)
        ctx, cmask = self._context(context, context_mask, proprio)
        pred = self._video_velocity(noisy, t.to(self.dtype), ctx, cmask)
        per = F.mse_loss(pred[:, :, 1:].float(), target[:, :, 1:].float(), reduction="none")
        per = per.mean(dim=(1, 3, 4)).mean(dim=1)
        return (per * sched.training_weight(t).to(per.device)).mean()

    def action_loss(
        self, obs: Obs, actions: Tensor, generator: torch.Generator | None = None
    ) -> Tensor:
        b = actions.shape[0]
        sched = self.model.train_action_scheduler
        u = torch.rand(b, generator=generator, device=generator_device(generator))
        sigma = sched._phi(u, sched.shift).to(self.device)
        eps = torch.randn(actions.shape, generator=generator, device=generator_device(generator))
        a = actions.to(self.device, torch.float32)
        eps = eps.to(self.device)
        s = sigma[:, None, None]
        v = self.velocity(self.prefill(obs), (1 - s) * a + s * eps, sigma)
        per = F.mse_loss(v.float(), eps - a, reduction="none").mean(dim=2).mean(dim=1)
        weight = sched.training_weight(sigma * float(sched.num_train_timesteps))
        return (per * weight.to(per.device)).mean()

    def features(
        self, video: Tensor, context: Tensor, context_mask: Tensor, proprio: Tensor
    ) -> Tensor:
        z = self.encode_video(video)
        ctx, cmask = self._context(context, context_mask, proprio)
        pre = self.model.video_expert.pre_dit(
            x=z, timestep=torch.zeros(z.shape[0], dtype=z.dtype, device=self.device),
            context=ctx, context_mask=cmask, action=None, fuse_vae_embedding_in_latents=True,
        )  # fmt: skip
        return self._video_blocks(pre)

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        actor = [*self.model.action_expert.parameters(), *self.model.proprio_encoder.parameters()]
        return {"actor": actor, "world_model": lora_parameters(self.model.video_expert)}

    def trainable_state(self) -> dict[str, Tensor]:
        """What a policy directory stores: the actor and world-model groups, by state_dict name."""
        ids = {id(p) for group in self.parameter_groups().values() for p in group}
        return {n: p for n, p in self.named_parameters() if id(p) in ids}

    def save(self, directory: Path) -> None:
        from wamrl.artifact import save_tensors

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.trainable_state().items()}
        save_tensors(state, directory / "model.safetensors")
        write_policy_yaml(directory / "policy.yaml", self.backend, config_to_dict(self.cfg))

    @classmethod
    def load(cls, directory: Path, device: str | torch.device = "cpu") -> FastWAMPolicy:
        directory = Path(directory)
        meta = read_policy_yaml(directory / "policy.yaml", cls.backend)
        cfg = FastWAMConfig.from_dict(meta["config"], where=str(directory / "policy.yaml"))
        weights = directory / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"checkpoint not found: {weights}")
        policy = from_release(cfg, device=device)
        policy.load_trainable(weights)
        return policy

    def load_trainable(self, path: Path) -> None:
        from wamrl.artifact import load_tensors

        path = Path(path)
        state = load_tensors(path, "checkpoint")
        _compare(path, {k: tuple(v.shape) for k, v in state.items()}, {
            k: tuple(v.shape) for k, v in self.trainable_state().items()
        })  # fmt: skip
        self.load_state_dict(state, strict=False)


def config_to_dict(cfg: FastWAMConfig) -> dict[str, Any]:
    return asdict(cfg)


def from_release(cfg: FastWAMConfig, device: str | torch.device = "cpu") -> FastWAMPolicy:
    """Check the files, build the official model, load the release weights, add LoRA."""
    payload = check_release_files(cfg)  # every file and shape, before any weight is allocated
    vae = _new_vae(cfg)
    _load_vae_weights(vae, Path(cfg.vae))
    model = build_official(cfg, device=device, vae=vae)
    load_release(model, payload, Path(cfg.checkpoint))
    return FastWAMPolicy(model.eval(), cfg)


def build_fastwam(cfg: dict[str, Any]) -> FastWAMPolicy:
    """build_policy() for `policy.backend: fastwam`: the release checkpoint, not a random model."""
    from wamrl.config import resolve_path
    from wamrl.envs.conventions import Normalizer

    fcfg = config_from_run(cfg)
    stats = resolve_path(cfg["policy"]["stats"])
    if not stats.is_file():
        raise FileNotFoundError(f"policy.stats: file not found: {stats}")
    norm = Normalizer.load(stats)
    if (norm.state_dim, norm.action_dim) != (PROPRIO_DIM, ACTION_DIM):
        raise ValueError(
            f"{stats}: state/action dims {norm.state_dim}/{norm.action_dim}, Fast-WAM on LIBERO "
            f"uses {PROPRIO_DIM}/{ACTION_DIM}"
        )
    if float(cfg["sampler"]["shift"]) != fcfg.shift:
        raise ValueError(
            f"sampler.shift ({cfg['sampler']['shift']}) != policy.fastwam.shift ({fcfg.shift})"
        )
    return from_release(fcfg, device="cpu")
