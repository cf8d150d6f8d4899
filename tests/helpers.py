"""Builders shared by several test files: configs, the small tiny policies and their inputs,
and the learner tests' synthetic run. tests/conftest.py wraps the common cases as fixtures;
tests that pass arguments (or run in a subprocess) import these directly."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import yaml

from wamrl import paths, sampler, store
from wamrl.atomic import sha256_file, write_json
from wamrl.config import load_config
from wamrl.envs.tasks import load_tasks
from wamrl.policy import build_policy, text
from wamrl.policy.base import Obs
from wamrl.policy.tiny import TinyConfig, TinyWAM

ROOT = Path(__file__).resolve().parents[1]
MICRO = ROOT / "tests" / "micro.yaml"

# ----------------------------------------------------------------------------- configs


def default_cfg() -> dict[str, Any]:
    """configs/default.yaml as written (not validated), on the CPU."""
    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    cfg["device"] = "cpu"
    return cfg


def small_cfg() -> dict[str, Any]:
    """The learner tests' config: default.yaml at a small model and store."""
    cfg = default_cfg()
    # A fresh model smaller than the default (the shipped base's dims): lr 1e-4 Adam steps
    # in the learner tests are sized for it.
    cfg["policy"]["tiny"].update(video_dim=128, action_dim=64, layers=4, heads=2)
    cfg["sampler"]["K"] = 4
    cfg["rollout"]["workers"] = 2
    cfg["rollout"]["group_size"] = 4
    cfg["reward"]["imagine_steps"] = 2
    cfg["actor"]["minibatch"] = 8
    cfg["actor"]["target_kl"] = None  # the tests' lr 1e-4 steps would pass it; tested on its own
    cfg["world_model"]["batch"] = 2
    cfg["world_model"]["windows_per_episode"] = 2
    return cfg


def micro_cfg(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """tests/micro.yaml (the smallest pipeline) under `overrides` (dotted keys), validated."""
    return load_config([MICRO], overrides)


# ----------------------------------------------------------------------------- tiny policies

# Every part of the tiny backend at a fraction of its default size.
SMALL_TINY = TinyConfig(
    video_dim=32, action_dim=32, layers=2, heads=2, head_dim=16, latent_channels=8,
    text_dim=48, text_max_len=8, lora_rank=4,
)  # fmt: skip
# One layer, a narrow FFN: the data-parallel and master-weight updates (test_ddp, test_master).
ONE_LAYER_TINY = TinyConfig(
    video_dim=32, action_dim=32, layers=1, heads=2, head_dim=16, ffn_mult=1, text_max_len=4
)


def make_tiny_policy(
    seed: int = 0,
    *,
    config: TinyConfig = SMALL_TINY,
    perturb: Literal["none", "signal", "sharp"] = "none",
) -> TinyWAM:
    """A TinyWAM from torch seed `seed` (train mode, as constructed).

    perturb "signal" gives the zero-initialised LoRA B and action positions random values,
    so that every path carries signal; "sharp" also sharpens the attention (at init it is
    nearly uniform, which would let errors in the cache hide below the tolerances).
    """
    torch.manual_seed(seed)
    model = TinyWAM(config)
    if perturb == "none":
        return model
    sharp = perturb == "sharp"
    with torch.no_grad():
        model.action_pos.normal_(0.0, 0.1)
        if sharp:
            model.video_in.weight.mul_(3.0)
        for n, p in model.named_parameters():
            if n.endswith("lora_b"):
                p.normal_(0.0, 0.05)
            if sharp and n.endswith(("qkv.weight", "qkv.base.weight")):
                p.mul_(3.0)
    return model


def make_obs(
    seed: int = 0,
    b: int = 2,
    *,
    ctx_len: int = 5,
    text_dim: int = SMALL_TINY.text_dim,
    row0_len: int | None = 3,
) -> Obs:
    """Random observations from their own generator: images and proprio in [-1, 1], a
    Gaussian text context whose row 0 is `row0_len` tokens long (every row full for None)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, ctx_len, dtype=torch.bool)
    if row0_len is not None:
        mask[0, row0_len:] = False  # a shorter instruction in row 0
    return Obs(
        image=torch.rand(b, 3, 224, 448, generator=g) * 2 - 1,
        proprio=torch.rand(b, 8, generator=g) * 2 - 1,
        context=torch.randn(b, ctx_len, text_dim, generator=g),
        context_mask=mask,
    )


# ----------------------------------------------------------------------------- a learner run

LENGTHS = [3, 2, 3, 1]  # macro-steps of the 4 episodes of each shard (one group of G = 4)
SUCCESS = [True, False, True, False]
VIDEO_FRAMES = 37  # >= 33: windows at t0 = 0..4 for the video-SFT episode
TASK = 3


def to_model(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() * (2 / 255) - 1


def sample_chains(policy, obs: Obs, K: int, a: float, shift: float, gen: torch.Generator):
    """Mixed ODE/SDE chains with one SDE step k* per sample (docs/design.md "The sampler")."""
    B = obs.batch_size
    sig = sampler.sigma_schedule(K, shift)
    k_star = torch.randint(1, K, (B,), generator=gen)
    x = torch.randn(B, 32, 7, generator=gen)
    chain, logp = [x], torch.zeros(B)
    with torch.no_grad():
        cache = policy.prefill(obs)
        for k in range(K):
            s, sn = sig[k].expand(B), sig[k + 1].expand(B)
            v = policy.velocity(cache, x, s)
            ode = x + (sn - s)[:, None, None] * v
            if (k_star == k).any():
                mu, std = sampler.sde_mean_std(x, v, s, sn, a)
                sde = mu + std * torch.randn(x.shape, generator=gen)
                lp = sampler.gaussian_log_prob(sde, mu, std)
                stoch = (k_star == k)[:, None, None]
                x = torch.where(stoch, sde, ode)
                logp = torch.where(k_star == k, lp, logp)
            else:
                x = ode
            chain.append(x)
    return torch.stack(chain, 1).numpy(), k_star.numpy().astype(np.int32), logp.numpy()


def make_run(tmp: Path, cfg: dict[str, Any]) -> Path:
    """iter_000/policy (as init makes it) + iter_001/rollouts/shard_{0,1}.zarr, written with
    store.ShardWriter from chains sampled with that policy (so log pi_old is the sampler's
    own), random images and random "rendered" frames."""
    run = tmp / "run"
    pdir = paths.policy_dir(run, 0)
    torch.manual_seed(0)
    policy = build_policy(cfg)
    policy.save(pdir)
    tasks = load_tasks()
    ctx, mask = text.encode_texts(
        [t.language for t in tasks], cfg["policy"]["tiny"]["text_max_len"]
    )
    text.save_contexts(pdir / "context.safetensors", [t.name for t in tasks], ctx, mask)
    stats = ROOT / cfg["policy"]["stats"]  # merge only copies it: any stats file will do
    (pdir / "stats.json").write_text(
        stats.read_text() if stats.exists() else '{"state": {}, "action": {}}'
    )
    write_json(
        pdir / "checkpoint.json",
        {"sha256": sha256_file(pdir / "model.safetensors"), "iteration": 0, "parents": {}},
    )
    context, mask = text.load_contexts(pdir / "context.safetensors")
    K, a, shift = cfg["sampler"]["K"], cfg["sampler"]["noise_a"], cfg["sampler"]["shift"]
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    for w in range(2):
        attrs = {
            "iteration": 1,
            "shard": w,
            "G": 4,
            "a": a,
            "policy_checkpoint": str(pdir),
            "policy_sha256": sha256_file(pdir / "model.safetensors"),
            "config": cfg,
        }
        with store.ShardWriter(
            paths.shard_path(run, 1, w), 4, max(LENGTHS), K, VIDEO_FRAMES, attrs
        ) as sw:
            for i, (t, succ) in enumerate(zip(LENGTHS, SUCCESS, strict=True)):
                img = rng.integers(0, 256, (t, 224, 448, 3), dtype=np.uint8)
                prop = rng.uniform(-1, 1, (t, 8)).astype(np.float32)
                obs = Obs(
                    to_model(img),
                    torch.from_numpy(prop),
                    context[TASK].expand(t, *context.shape[1:]),
                    mask[TASK].expand(t, *mask.shape[1:]),
                )
                chain, ks, lp = sample_chains(policy, obs, K, a, shift, gen)
                r_task = np.zeros(t, np.float32)
                r_task[-1] = float(succ)
                done = np.arange(t) == t - 1
                video = i == 0  # one successful video-SFT episode per shard
                sw.write_episode(
                    i,
                    store.EpisodeData(
                        task=TASK,
                        init_state=0,
                        group=0,
                        success=succ,
                        video_sft=video,
                        env_crashed=False,
                        length=t,
                        image=img,
                        proprio=prop,
                        chain=chain,
                        k_star=ks,
                        logp_old=lp,
                        r_task=r_task,
                        done=done,
                        frames=rng.integers(0, 256, (t, 2, 224, 448, 3), dtype=np.uint8),
                        video_frames=rng.integers(
                            0, 256, (VIDEO_FRAMES, 224, 448, 3), dtype=np.uint8
                        )
                        if video
                        else None,
                        video_proprio=rng.uniform(-1, 1, (VIDEO_FRAMES, 8)).astype(np.float32)
                        if video
                        else None,
                    ),
                )
    return run
