"""The `fastwam` backend (wamrl/policy/fastwam.py) and the context stage.

Tests that need the official Fast-WAM package skip without it (it is an optional dependency
that wamrl does not install). They build a randomly initialised official model at reduced
size in float32 and check that our sampler over the adapter reproduces the official
`FastWAM.infer_action`, `infer_joint`'s video, and the official LIBERO eval preprocessing.
The config and missing-file tests run everywhere.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests import helpers
from wamrl.config import CONFIG_DIR, ConfigError, load_config
from wamrl.policy.base import Obs

FASTWAM_CONFIG = CONFIG_DIR / "fastwam.yaml"
SKIP_REASON = (
    "the official Fast-WAM package (import name `fastwam`) is not installed; it is an optional "
    "dependency of the fastwam backend (docs/fastwam.md)"
)


def _official():
    pytest.importorskip("fastwam.models.wan22.fastwam", reason=SKIP_REASON)
    from wamrl.policy.fastwam import import_fastwam

    return import_fastwam()


# ----------------------------------------------------------------------------- everywhere


def test_fastwam_config_validates():
    cfg = load_config([FASTWAM_CONFIG])
    assert cfg["policy"]["backend"] == "fastwam"
    f = cfg["policy"]["fastwam"]
    assert f["shift"] == cfg["sampler"]["shift"] == 5.0
    assert f["arch"]["num_layers"] == 30 and f["arch"]["text_dim"] == 4096
    assert f["context_len"] == 128


def test_fastwam_config_refuses_unknown_and_bad_keys():
    with pytest.raises(ConfigError, match=r"policy\.fastwam\.bogus: unknown key"):
        load_config([FASTWAM_CONFIG], {"policy": {"fastwam": {"bogus": 1}}})
    with pytest.raises(ConfigError, match=r"policy\.fastwam\.dtype"):
        load_config([FASTWAM_CONFIG], {"policy": {"fastwam": {"dtype": "int8"}}})
    with pytest.raises(ConfigError, match=r"policy\.fastwam\.arch\.num_layers"):
        load_config([FASTWAM_CONFIG], {"policy": {"fastwam": {"arch": {"num_layers": 0}}}})


def _cfg_with(tmp_path: Path, **files: str) -> dict:
    paths = {}
    for key in ("checkpoint", "vae", "text_encoder", "tokenizer"):
        p = tmp_path / f"{key}.bin"
        if key not in files:
            p.write_bytes(b"x")
        paths[key] = str(files.get(key, p))
    return load_config([FASTWAM_CONFIG], {"policy": {"fastwam": paths}})


@pytest.mark.parametrize("which", ["checkpoint", "vae"])
def test_missing_release_file_is_named(tmp_path, which):
    from wamrl.policy.fastwam import check_release_files, config_from_run

    missing = tmp_path / "nowhere" / f"{which}.pt"
    cfg = config_from_run(_cfg_with(tmp_path, **{which: str(missing)}))
    with pytest.raises(FileNotFoundError, match=rf"policy\.fastwam\.{which}: .*{missing}"):
        check_release_files(cfg)


def test_missing_stats_file_is_named(tmp_path):
    from wamrl.policy import build_policy

    cfg = _cfg_with(tmp_path)
    cfg["policy"]["stats"] = str(tmp_path / "no_stats.json")
    with pytest.raises(FileNotFoundError, match=r"policy\.stats: .*no_stats\.json"):
        build_policy(cfg)


@pytest.mark.parametrize("which", ["text_encoder", "tokenizer"])
def test_missing_text_encoder_file_is_named(tmp_path, which):
    from wamrl.policy.context import official_encoder

    missing = tmp_path / f"gone_{which}"
    cfg = _cfg_with(tmp_path, **{which: str(missing)})
    with pytest.raises(FileNotFoundError, match=rf"policy\.fastwam\.{which}: .*gone_{which}"):
        official_encoder(cfg)


def test_import_error_says_how_to_install(tmp_path, monkeypatch):
    from wamrl.policy.fastwam import check_release_files, config_from_run

    for name in [m for m in sys.modules if m == "fastwam" or m.startswith("fastwam.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "fastwam", None)  # makes `import fastwam...` fail
    cfg = config_from_run(_cfg_with(tmp_path))
    with pytest.raises(ImportError, match=r"official Fast-WAM package .*pip install"):
        check_release_files(cfg)


def test_context_stage_layout_and_reuse(tmp_path):
    """context/context.safetensors in save_contexts' layout, prompts from the template,
    FastWAM.encode_prompt's zeroed padding + all-True mask; reused when nothing changed."""
    from wamrl.envs.tasks import load_tasks
    from wamrl.policy.context import CONTEXT_DIR, CONTEXT_FILE, prompt_template, task_contexts
    from wamrl.policy.text import load_contexts

    cfg = _cfg_with(tmp_path)
    L = cfg["policy"]["fastwam"]["context_len"]
    calls = []

    def fake_encoder(prompts):  # stands in for umT5: prompt i has i % 7 + 3 tokens
        calls.append(prompts)
        mask = torch.zeros(len(prompts), L, dtype=torch.bool)
        for i in range(len(prompts)):
            mask[i, : i % 7 + 3] = True
        from wamrl.policy.context import zero_padding

        return zero_padding(torch.randn(len(prompts), L, 16), mask)

    tasks = load_tasks()
    ctx, mask = task_contexts(cfg, tmp_path, tasks, encoder=fake_encoder)
    assert ctx.shape == (40, L, 16) and mask.shape == (40, L) and bool(mask.all())
    assert calls[0][0] == prompt_template().format(task=tasks[0].language)
    assert bool((ctx[0, 3:] == 0).all()) and bool((ctx[0, :3] != 0).any())
    from safetensors import safe_open

    with safe_open(str(tmp_path / CONTEXT_DIR / CONTEXT_FILE), "pt") as f:
        assert f.metadata()["names"].split("\n") == [t.name for t in tasks]
    c2, _ = task_contexts(cfg, tmp_path, tasks, encoder=fake_encoder)
    assert len(calls) == 1 and torch.equal(c2, ctx)  # reused, encoder not called again
    c3, _ = load_contexts(tmp_path / CONTEXT_DIR / CONTEXT_FILE)
    assert torch.equal(c3, ctx)


# ----------------------------------------------------------------------------- official model

ARCH = dict(
    video_hidden_dim=64, video_ffn_dim=128, action_hidden_dim=48, action_ffn_dim=96,
    num_heads=2, head_dim=24, num_layers=2, text_dim=32,
)  # fmt: skip
L_CTX = 12


def small_vae(ns, seed: int = 0) -> nn.Module:
    """The official Wan2.2 VAE class with a small inner VideoVAE38_ (the real one is 700M)."""
    g = torch.Generator().manual_seed(seed)
    vae = ns.WanVideoVAE38.__new__(ns.WanVideoVAE38)
    nn.Module.__init__(vae)
    vae.mean = torch.randn(48, generator=g) * 0.1
    vae.std = torch.rand(48, generator=g) + 0.5
    vae.scale = [vae.mean, 1.0 / vae.std]
    torch.manual_seed(seed)
    vae.model = ns.VideoVAE38_(dim=8, z_dim=48, dec_dim=8).eval().requires_grad_(False)
    vae.upsampling_factor, vae.temporal_downsample_factor, vae.z_dim = 16, 4, 48
    return vae


def fastwam_cfg(tmp_path: Path | None = None, **kw):
    """The backend's config at the reduced ARCH in float32; with tmp_path, its files there."""
    from wamrl.policy.fastwam import FastWAMArch, FastWAMConfig

    base = dict(checkpoint="unused.pt", vae="unused.safetensors", dtype="float32", lora_rank=4)
    if tmp_path is not None:
        base.update(checkpoint=str(tmp_path / "release.pt"), vae=str(tmp_path / "vae.safetensors"))
    base.update(kw)
    return FastWAMConfig(**base, arch=FastWAMArch(**ARCH))


def official_model(ns, seed: int = 0, imagine_frames: int = 3):
    """A random official FastWAM at reduced size, with sharpened attention so that every
    path (cache, mask, proprio token) carries signal."""
    from wamrl.policy.fastwam import build_official

    torch.manual_seed(seed)
    model = build_official(
        fastwam_cfg(imagine_latent_frames=imagine_frames), vae=small_vae(ns, seed)
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("self_attn.q.weight", "self_attn.k.weight")):
                p.mul_(3.0)
        model.proprio_encoder.weight.mul_(5.0)
    return model.eval()


def wrap(model, **kw):
    from wamrl.policy.fastwam import FastWAMPolicy

    return FastWAMPolicy(model, fastwam_cfg(**kw)).eval()


def make_obs(b: int = 1, seed: int = 0) -> Obs:
    """Random observations at this model's context shape, every token real."""
    return helpers.make_obs(seed, b, ctx_len=L_CTX, text_dim=ARCH["text_dim"], row0_len=None)


@pytest.fixture(scope="module")
def ns():
    return _official()


@pytest.fixture(scope="module")
def model(ns):
    return official_model(ns)


@pytest.fixture(scope="module")
def policy(model):
    return wrap(model)


@pytest.mark.parametrize("K", [8, 20])
def test_sampler_a0_reproduces_official_infer_action(model, policy, K):
    from wamrl.sampler import sample_chunk

    obs = make_obs()
    seed = 42
    ref = model.infer_action(
        prompt=None, input_image=obs.image[0], action_horizon=32, proprio=obs.proprio[0],
        context=obs.context[0], context_mask=obs.context_mask[0], num_inference_steps=K,
        seed=seed,
    )["action"]  # fmt: skip
    x0 = torch.randn((1, 32, 7), generator=torch.Generator().manual_seed(seed))  # its noise
    with torch.no_grad():
        res = sample_chunk(policy, policy.prefill(obs), 1, K, 0.0, 5.0, None, x0=x0)
    diff = float((res.chain[0, -1] - ref).abs().max())
    print(
        f"infer_action parity K={K}: max abs diff {diff:.3g} (|a| max {float(ref.abs().max()):.3g})"
    )
    assert diff <= 1e-5
    assert float(ref.abs().max()) > 0.1  # not a trivially small output


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_official_protocol_reproduces_the_official_eval_queries(ns, dtype):
    """eval.protocol official against Fast-WAM's eval loop, whose every query is
    infer_action(num_inference_steps=10, seed=42) in the model dtype: two queries of one
    episode (different observations) through stages/eval.py's protocol, rollout's per-query
    noise and the sampler's scheduler dtype give the official actions."""
    from stages.eval import episode_noise, resolve_protocol
    from wamrl.envs.tasks import load_tasks
    from wamrl.rollout import EpisodeSpec, _eval_noise, _Running
    from wamrl.sampler import sample_chunk

    over = {"eval.protocol": "official", "policy.fastwam.dtype": dtype}
    protocol = resolve_protocol(load_config([FASTWAM_CONFIG], over))
    assert (protocol.K, protocol.scheduler_dtype) == (10, dtype)
    model = official_model(ns).to(getattr(torch, dtype))
    pol = wrap(model, dtype=dtype)
    seed, reseed = episode_noise(protocol, 1234, 0, 0)
    spec = EpisodeSpec(load_tasks()[0], 0, 0, False, seed, reseed)
    ep = _Running(0, spec, torch.Generator().manual_seed(seed))
    for query in range(2):
        obs = make_obs(seed=20 + query)
        ref = model.infer_action(
            prompt=None, input_image=obs.image[0], action_horizon=32, proprio=obs.proprio[0],
            context=obs.context[0], context_mask=obs.context_mask[0], num_inference_steps=10,
            seed=42,
        )["action"]  # fmt: skip
        with torch.no_grad():
            res = sample_chunk(
                pol, pol.prefill(obs), 1, protocol.K, 0.0, 5.0, None, x0=_eval_noise(ep)[None],
                scheduler_dtype=getattr(torch, protocol.scheduler_dtype),
            )  # fmt: skip
        diff = float((res.chain[0, -1] - ref).abs().max())
        print(f"official protocol {dtype}, query {query}: max abs diff {diff:.3g}")
        assert diff <= (1e-5 if dtype == "float32" else 0.0)
        assert float(ref.abs().max()) > 0.1


def test_cached_velocity_equals_official_joint_forward(model, policy):
    """Our cache path vs the official uncached joint MoT pass (_predict_action_noise)."""
    obs = make_obs(b=2, seed=1)
    x = torch.randn(2, 32, 7, generator=torch.Generator().manual_seed(3))
    sigma = torch.tensor([0.9, 0.3])
    with torch.no_grad():
        ours = policy.velocity(policy.prefill(obs), x, sigma)
        for i in range(2):
            ctx, cmask = policy._context(obs.context[i : i + 1], obs.context_mask[i : i + 1],
                                         obs.proprio[i : i + 1])  # fmt: skip
            ref = model._predict_action_noise(
                first_frame_latents=policy.encode_image(obs.image[i : i + 1]),
                latents_action=x[i : i + 1], timestep_action=sigma[i : i + 1] * 1000.0,
                context=ctx, context_mask=cmask, fuse_vae_embedding_in_latents=True,
            )  # fmt: skip
            assert float((ours[i] - ref[0]).abs().max()) <= 1e-5


def test_batched_prefill_matches_single(policy):
    obs = make_obs(b=2, seed=2)
    x = torch.randn(2, 32, 7, generator=torch.Generator().manual_seed(4))
    s = torch.tensor([0.7, 0.7])
    with torch.no_grad():
        both = policy.velocity(policy.prefill(obs), x, s)
        one = policy.velocity(
            policy.prefill(Obs(obs.image[1:], obs.proprio[1:], obs.context[1:],
                               obs.context_mask[1:])), x[1:], s[1:],
        )  # fmt: skip
    assert float((both[1] - one[0]).abs().max()) <= 1e-5


def test_mixed_sampler_log_probs_recompute_exactly(policy):
    from wamrl.sampler import recompute_log_prob, sample_chunk

    obs = make_obs(b=3, seed=5)
    K, a = 8, 0.5
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        res = sample_chunk(policy, policy.prefill(obs), 3, K, a, 5.0, gen)
    idx = torch.arange(3)
    x_k, x_next = res.chain[idx, res.k_star], res.chain[idx, res.k_star + 1]
    with torch.no_grad():
        cache = policy.prefill(obs)
    logp = recompute_log_prob(policy, None, x_k, x_next, res.k_star, K, a, 5.0, cache=cache)
    diff = float((logp.detach() - res.logp).abs().max())
    print(
        f"log-prob recompute: max abs diff {diff:.3g} (|log pi| ~ {float(res.logp.abs().max()):.4g})"
    )
    assert diff <= 1e-3 and diff / float(res.logp.abs().max()) < 1e-6
    # the gradient reaches the action expert and the proprio encoder, not the video expert
    policy.zero_grad(set_to_none=True)
    logp.sum().backward()
    groups = policy.parameter_groups()
    assert all(p.grad is not None for p in policy.model.proprio_encoder.parameters())
    assert sum(p.grad is not None for p in groups["actor"]) > len(groups["actor"]) // 2
    assert all(p.grad is None for p in policy.model.video_expert.parameters())
    policy.zero_grad(set_to_none=True)


def test_parameter_groups_and_lora_start_at_zero(policy):
    g = policy.parameter_groups()
    actor, wm = {id(p) for p in g["actor"]}, {id(p) for p in g["world_model"]}
    assert actor and wm and not (actor & wm)
    assert {id(p) for p in policy.model.action_expert.parameters()} <= actor
    assert {id(p) for p in policy.model.proprio_encoder.parameters()} <= actor
    names = {n for n, p in policy.named_parameters() if id(p) in wm}
    assert all(n.startswith("model.video_expert.blocks.") for n in names)
    assert all(float(p.detach().abs().max()) == 0 for n, p in policy.named_parameters()
               if n.endswith("lora_b"))  # fmt: skip


def test_imagine_matches_official_infer_joint_video(ns):
    """imagine(+4, +8) = frames 1, 2 of the official infer_joint video (same seed)."""
    model = official_model(ns, seed=3)
    pol = wrap(model, imagine_latent_frames=2)
    obs = make_obs(seed=6)
    steps, seed = 3, 11
    ref = model.infer_joint(
        prompt=None, input_image=obs.image[0], num_video_frames=5, action_horizon=32,
        proprio=obs.proprio[0], context=obs.context[0], context_mask=obs.context_mask[0],
        num_inference_steps=steps, seed=seed, test_action_with_infer_action=False,
    )["video"]  # fmt: skip
    with torch.no_grad():
        out = pol.imagine(obs, 2, steps, generator=torch.Generator().manual_seed(seed))
    assert out.shape == (1, 2, 3, 224, 448)
    ours = ((out[0] + 1.0) * 127.5).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for j in range(2):
        diff = np.abs(ours[j].astype(int) - np.asarray(ref[1 + j]).astype(int)).max()
        print(f"imagine vs infer_joint, frame +{4 * (j + 1)}: max {diff} uint8 levels")
        assert diff <= 1, f"frame +{4 * (j + 1)}: {diff} levels"


def test_losses_and_features_run_with_gradients(policy):
    obs = make_obs(b=2, seed=8)
    video = torch.rand(2, 5, 3, 224, 448, generator=torch.Generator().manual_seed(9)) * 2 - 1
    gen = torch.Generator().manual_seed(0)
    policy.train()
    try:
        lv = policy.video_loss(video, obs.context, obs.context_mask, obs.proprio, generator=gen)
        la = policy.action_loss(obs, torch.rand(2, 32, 7) * 2 - 1, generator=gen)
        feats = policy.features(video, obs.context, obs.context_mask, obs.proprio)
    finally:
        policy.eval()
    assert torch.isfinite(lv) and torch.isfinite(la)
    assert feats.shape == (2, 2 * 98, ARCH["video_hidden_dim"])
    policy.zero_grad(set_to_none=True)
    lv.backward()
    assert any(p.grad is not None for p in policy.parameter_groups()["world_model"])
    policy.zero_grad(set_to_none=True)


def _write_release(ns, model, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.save(
        {"mot": model.mot.state_dict(), "proprio_encoder": model.proprio_encoder.state_dict(),
         "step": 0, "torch_dtype": "torch.float32"},
        tmp_path / "release.pt",
    )  # fmt: skip
    vae_state = {k[len("model.") :]: v.contiguous() for k, v in model.vae.state_dict().items()}
    save_file(vae_state, str(tmp_path / "vae.safetensors"))


def test_release_load_save_roundtrip_and_mismatch_named(ns, tmp_path, monkeypatch):
    import wamrl.policy.fastwam as fw
    from wamrl.policy import load_policy

    monkeypatch.setattr(fw, "_new_vae", lambda cfg: small_vae(ns, 0))
    ref_model = official_model(ns, seed=0)
    _write_release(ns, ref_model, tmp_path)
    pol = fw.from_release(fastwam_cfg(tmp_path))
    obs = make_obs(seed=10)
    x = torch.randn(1, 32, 7)
    s = torch.tensor([0.5])
    ref = wrap(ref_model)
    with torch.no_grad():
        assert torch.equal(
            pol.velocity(pol.prefill(obs), x, s), ref.velocity(ref.prefill(obs), x, s)
        )
        for p in pol.parameter_groups()["world_model"]:
            p.normal_(0.0, 0.05)
        pol.model.action_expert.head.bias.add_(0.3)
        v1 = pol.velocity(pol.prefill(obs), x, s)
    pol.save(tmp_path / "policy")
    loaded = load_policy(tmp_path / "policy")
    with torch.no_grad():
        assert torch.equal(loaded.velocity(loaded.prefill(obs), x, s), v1)
    # a release for another architecture: the file and a tensor are named, before building
    from wamrl.policy.fastwam import FastWAMArch, FastWAMConfig

    other = FastWAMConfig(
        checkpoint=str(tmp_path / "release.pt"), vae=str(tmp_path / "vae.safetensors"),
        dtype="float32", arch=FastWAMArch(**{**ARCH, "action_hidden_dim": 24}),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"release\.pt: tensor mixtures\.action\.\S+ has shape"):
        fw.check_release_files(other)


# ----------------------------------------------------------------------------- conventions


def _official_eval_functions() -> dict:
    """The preprocessing functions of the official LIBERO eval script, taken from its source
    (the script itself imports libero, hydra and accelerate at module level)."""
    import fastwam

    root = Path(fastwam.__file__).resolve().parents[2]
    ev = root / "experiments" / "libero" / "eval_libero_single.py"
    ut = root / "experiments" / "libero" / "libero_utils.py"
    if not (ev.is_file() and ut.is_file()):
        pytest.skip(
            f"the official repository's experiments/libero/ is not next to {fastwam.__file__}"
        )
    from PIL import Image

    ns: dict = {"np": np, "torch": torch, "Image": Image, "math": __import__("math")}
    wanted = {"_center_crop_resize", "_extract_sim_state", "_denormalize_action",
              "get_libero_image", "quat2axisangle", "invert_gripper_action"}  # fmt: skip
    for path in (ut, ev):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in wanted:
                node.decorator_list = []
                exec(compile(ast.Module([node], []), str(path), "exec"), ns)
    missing = wanted - set(ns)
    assert not missing, f"official eval functions not found: {missing}"
    return ns


def _recorded_obs(seed: int = 0) -> dict:
    """A fixed robosuite observation (256 px renders, a plausible arm state)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=4)
    q /= np.linalg.norm(q)
    return {
        "agentview_image": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
        "robot0_eye_in_hand_image": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
        "robot0_eef_pos": np.array([-0.21, 0.03, 1.17]),
        "robot0_eef_quat": q,
        "robot0_gripper_qpos": np.array([0.0385, -0.0387]),
    }


def _official_stats(rng) -> dict:
    def entry(d, lo, hi):
        mn = lo + rng.random(d) * 0.1
        mx = hi - rng.random(d) * 0.1
        return {"global_min": mn.tolist(), "global_max": mx.tolist(),
                "global_mean": ((mn + mx) / 2).tolist(), "global_std": (mx - mn).tolist()}  # fmt: skip

    return {"state": {"default": entry(8, -3.0, 3.0)}, "action": {"default": entry(7, -1.0, 1.0)},
            "num_episodes": 1, "num_transition": 1}  # fmt: skip


def test_conventions_match_official_eval_preprocessing(ns):
    from fastwam.datasets.lerobot.utils.normalizer import SingleFieldLinearNormalizer

    from wamrl.envs.conventions import (
        Normalizer,
        env_actions,
        image_to_model_input,
        model_image,
        raw_proprio,
    )

    off = _official_eval_functions()
    obs = _recorded_obs()
    # image: rotate 180, centre-crop-resize each camera to 224, [agent | wrist], x*2/255 - 1
    imgs = off["get_libero_image"](obs)
    rgb = np.concatenate(
        [
            off["_center_crop_resize"](imgs[k], width=224, height=224)
            for k in ("image", "wrist_image")
        ],
        axis=1,
    )
    ref_x = torch.tensor(rgb).permute(2, 0, 1).unsqueeze(0).float() * (2.0 / 255.0) - 1.0
    ours_img = model_image(obs["agentview_image"], obs["robot0_eye_in_hand_image"])
    assert np.array_equal(ours_img, rgb)
    assert torch.equal(image_to_model_input(ours_img)[None], ref_x)
    # proprio: eef_pos + axis-angle + gripper qpos, min/max-normalised (official normaliser)
    assert np.allclose(raw_proprio(obs), off["_extract_sim_state"](obs), atol=1e-6)
    rng = np.random.default_rng(1)
    stats = _official_stats(rng)
    mm = {k: {"min": v["default"]["global_min"], "max": v["default"]["global_max"]}
          for k, v in stats.items() if k in ("state", "action")}  # fmt: skip
    ours = Normalizer({k: {"default": v} for k, v in mm.items()})

    def official(kind):
        e = stats[kind]["default"]
        return SingleFieldLinearNormalizer(
            {k.removeprefix("global_"): torch.tensor(v) for k, v in e.items()}, mode="min/max"
        )

    ref_p = official("state").forward(torch.as_tensor(raw_proprio(obs)).unsqueeze(0))
    assert np.allclose(ours.normalize_state(raw_proprio(obs)), ref_p.numpy()[0], atol=1e-6)
    # action: de-normalise, gripper 2g - 1, negate, sign (binarize_gripper: true)
    chunk = np.clip(rng.normal(size=(32, 7)) * 0.6, -1, 1)
    chunk[:, 6] = np.where(np.arange(32) % 2 == 0, 0.9, -0.8)
    ref_a = official("action").backward(torch.tensor(chunk)).numpy()
    ref_a[..., -1] = ref_a[..., -1] * 2 - 1
    ref_a = off["invert_gripper_action"](ref_a)
    ref_a[..., -1] = np.sign(ref_a[..., -1])
    assert np.allclose(env_actions(chunk, ours, replan=10), ref_a[:10], atol=1e-6)


def test_normalizer_reads_the_official_stats_format(tmp_path):
    """The release's dataset_stats json names the range global_min / global_max."""
    from wamrl.envs.conventions import Normalizer

    stats = _official_stats(np.random.default_rng(0))
    path = tmp_path / "dataset_stats.json"
    path.write_text(json.dumps(stats))
    norm = Normalizer.load(path)
    lo = np.asarray(stats["state"]["default"]["global_min"])
    hi = np.asarray(stats["state"]["default"]["global_max"])
    np.testing.assert_allclose(norm.normalize_state(lo), -1.0, atol=1e-6)
    np.testing.assert_allclose(norm.normalize_state(hi), 1.0, atol=1e-6)
    np.testing.assert_allclose(norm.normalize_state((lo + hi) / 2), 0.0, atol=1e-6)


def test_prompt_template_is_the_official_one():
    pytest.importorskip("fastwam", reason=SKIP_REASON)
    import fastwam

    from wamrl.policy.context import prompt_template

    src = Path(fastwam.__file__).parent / "datasets" / "lerobot" / "robot_video_dataset.py"
    tree = ast.parse(src.read_text())
    found = [
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign)
        and any(getattr(t, "id", "") == "DEFAULT_PROMPT" for t in n.targets)
    ]
    assert found == [prompt_template()]
