"""Demo store, 10-of-32 chunking, statistics and SFT batches/updates (wamrl.demos, wamrl.sft)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from stages.demos import attempts
from tests.helpers import micro_cfg
from wamrl.contract import CHUNK_LEN
from wamrl.demos import (
    Demo,
    DemoSet,
    action_chunk,
    demo_stats,
    load_demos,
    n_frames,
    n_queries,
    rendered_steps,
    write_demo_store,
)
from wamrl.envs.conventions import Normalizer
from wamrl.policy.tiny import TinyConfig, TinyWAM
from wamrl.sft import Batches, lr_at, random_shift, steps_within, train
from wamrl.store import StoreError


def fake_demo(task: int, length: int, seed: int) -> Demo:
    rng = np.random.default_rng(seed)
    return Demo(
        task=task,
        init_state=seed,
        state=rng.normal(size=(length, 8)).astype(np.float32),
        action=np.concatenate(
            [rng.uniform(-1, 1, (length, 6)), rng.integers(0, 2, (length, 1))], 1
        ).astype(np.float32),
        images=rng.integers(0, 256, (n_queries(length), 224, 448, 3), dtype=np.uint8),
        frames=rng.integers(0, 256, (n_frames(length), 224, 448, 3), dtype=np.uint8),
    )


def test_chunking_counts() -> None:
    assert [n_queries(n) for n in (1, 10, 11, 25)] == [1, 1, 2, 3]  # queries at 0, 10, 20
    assert [n_frames(n) for n in (1, 4, 7, 8)] == [1, 2, 2, 3]  # frames at 0, 4, 8 <= L
    assert rendered_steps(12) == {0, 4, 8, 10, 12}


def test_action_chunk_holds_still_past_the_end() -> None:
    action = np.arange(40 * 7, dtype=np.float32).reshape(40, 7)
    np.testing.assert_array_equal(action_chunk(action, 0), action[:32])
    tail = action_chunk(action, 30)
    assert tail.shape == (CHUNK_LEN, 7)
    np.testing.assert_array_equal(tail[:10], action[30:40])
    np.testing.assert_array_equal(tail[10:, :6], 0.0)  # no motion
    np.testing.assert_array_equal(tail[10:, 6], action[-1, 6])  # the last gripper command


def test_store_round_trip_and_stats(tmp_path) -> None:
    demos = [fake_demo(3, 23, 0), fake_demo(7, 9, 1)]
    path = tmp_path / "demos" / "shard_000.zarr"
    write_demo_store(path, demos, {"worker": 0})
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp left
    loaded = load_demos([path])
    assert loaded.task.tolist() == [3, 7] and loaded.length.tolist() == [23, 9]
    for d, s, a, im, fr in zip(
        demos, loaded.state, loaded.action, loaded.images, loaded.frames, strict=True
    ):
        np.testing.assert_array_equal(s, d.state)
        np.testing.assert_array_equal(a, d.action)
        np.testing.assert_array_equal(im, d.images)
        np.testing.assert_array_equal(fr, d.frames)
    root = zarr.open_group(str(path), mode="r")
    assert root["step/image"].metadata.dimension_names[:2] == ("episode", "query")
    assert root.attrs["query_every"] == 10 and root.attrs["chunk"] == 32
    stats = demo_stats(loaded)
    every_state = np.concatenate([d.state for d in demos])
    np.testing.assert_allclose(stats["state"]["libero_proprio"]["min"], every_state.min(0))
    np.testing.assert_allclose(stats["state"]["libero_proprio"]["max"], every_state.max(0))
    every_action = np.concatenate([d.action for d in demos])
    np.testing.assert_allclose(stats["action"]["libero_osc_pose"]["mean"], every_action.mean(0))
    Normalizer(stats)  # Fast-WAM's format, readable by the rollout's normaliser


def test_incomplete_store_is_refused(tmp_path) -> None:
    path = tmp_path / "shard_000.zarr"
    write_demo_store(path, [fake_demo(0, 12, 0)], {})
    root = zarr.open_group(str(path), mode="r+")
    del root.attrs["complete"]
    with pytest.raises(StoreError, match="incomplete"):
        load_demos([path])
    with pytest.raises(StoreError, match="not a zarr store"):
        load_demos([tmp_path / "nothing.zarr"])
    with pytest.raises(ValueError, match="no successful"):
        write_demo_store(tmp_path / "empty.zarr", [], {})


def test_lr_schedule() -> None:
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(100, 100, 1.0, 10) == pytest.approx(0.1)


CFG = TinyConfig(
    video_dim=32, action_dim=32, layers=2, heads=2, head_dim=16, latent_channels=8,
    text_dim=16, text_max_len=4, lora_rank=2,
)  # fmt: skip
SFT = {
    "steps": 30, "batch": 8, "video_batch": 2, "video_frames": 3, "video_weight": 0.5,
    "lr": 3e-3, "weight_decay": 0.0, "warmup": 2, "grad_clip": 1.0, "log_every": 1,
}  # fmt: skip


def batches(demos: list[Demo], augment_shift: int = 0) -> Batches:
    ds = DemoSet(
        np.array([d.task for d in demos], np.int32),
        np.array([d.length for d in demos], np.int32),
        [d.state for d in demos],
        [d.action for d in demos],
        [d.images for d in demos],
        [d.frames for d in demos],
    )
    ctx = torch.randn(
        40, CFG.text_max_len, CFG.text_dim, generator=torch.Generator().manual_seed(0)
    )
    mask = torch.ones(40, CFG.text_max_len, dtype=torch.bool)
    return Batches(ds, Normalizer(demo_stats(ds)), ctx, mask, torch.device("cpu"), augment_shift)


def test_batches_are_the_normalised_chunks() -> None:
    demos = [fake_demo(5, 25, 0), fake_demo(9, 14, 1)]
    b = batches(demos)
    assert len(b.queries) == n_queries(25) + n_queries(14)
    rng = np.random.default_rng(0)
    pick = b.queries[np.random.default_rng(0).integers(len(b.queries), size=4)]
    obs, target = b.actions(rng, 4)
    for row, (e, q) in enumerate(pick):
        d = demos[e]
        want = b.norm.normalize_action(action_chunk(d.action, 10 * q))
        np.testing.assert_allclose(target[row].numpy(), want, atol=1e-6)
        np.testing.assert_allclose(
            obs.proprio[row].numpy(), b.norm.normalize_state(d.state[10 * q]), atol=1e-6
        )
        img = d.images[q].astype(np.float32) * 2 / 255 - 1
        np.testing.assert_allclose(obs.image[row].permute(1, 2, 0).numpy(), img, atol=1e-6)
        torch.testing.assert_close(obs.context[row], b.context[d.task])
    video, ctx, mask, proprio = b.video(rng, 3, 3)
    assert video.shape == (3, 3, 3, 224, 448) and proprio.shape == (3, 8)
    assert b.video(rng, 1, 100) is None  # no episode has 100 frames


def test_sft_lowers_both_losses() -> None:
    torch.manual_seed(0)
    policy = TinyWAM(CFG)
    log = train(policy, batches([fake_demo(1, 30, 0), fake_demo(2, 20, 1)]), SFT, seed=0)
    assert len(log) == SFT["steps"]
    first = (
        np.mean([r["action_loss"] for r in log[:5]]),
        np.mean([r["video_loss"] for r in log[:5]]),
    )
    last = (
        np.mean([r["action_loss"] for r in log[-5:]]),
        np.mean([r["video_loss"] for r in log[-5:]]),
    )
    assert last[0] < 0.8 * first[0] and last[1] < first[1]
    assert not policy.training


def test_steps_within_fits_the_rest_of_the_budget_at_the_measured_rate() -> None:
    # 10 steps in 2 s = 0.2 s/step; 58 s left hold 290 more steps.
    assert steps_within(60.0, 2.0, 10, 1000) == 300
    assert steps_within(60.0, 2.0, 10, 100) == 100  # the configured count is a cap
    assert steps_within(1.0, 2.0, 10, 100) == 11  # budget already spent: stop after one more


def test_time_budget_cuts_the_run_and_ends_the_schedule_on_time() -> None:
    torch.manual_seed(0)
    cfg = {**SFT, "steps": 10_000, "warmup": 2, "log_every": 1000, "time_budget_s": 1.0}
    log = train(TinyWAM(CFG), batches([fake_demo(1, 30, 0)]), cfg, seed=0)
    last = log[-1]
    assert 10 < last["step"] + 1 < 10_000  # cut after the 10 timed steps (no wall-time bound:
    # a loaded machine makes those slower, and then the cut comes sooner)
    # The cut count is the schedule's length: the last step sits at the cosine's floor.
    assert last["lr"] == pytest.approx(lr_at(last["step"], last["step"] + 1, cfg["lr"], 2))


def test_snapshots_come_every_save_every_steps_before_the_last() -> None:
    torch.manual_seed(0)
    policy = TinyWAM(CFG)
    seen: list[tuple[int, bool]] = []
    cfg = {**SFT, "steps": 25, "save_every": 10}
    train(
        policy,
        batches([fake_demo(1, 30, 0)]),
        cfg,
        0,
        on_snapshot=lambda s: seen.append((s, policy.training)),
    )
    assert seen == [(10, False), (20, False)]  # saved in eval mode; none at 25: that is the final
    assert not policy.training


def test_random_shift_moves_each_view_by_its_own_offset() -> None:
    img = torch.randn(3, 3, 224, 448)
    out = random_shift(img, 5, torch.Generator().manual_seed(1))
    dy, dx = torch.randint(-5, 6, (2, 6, 1), generator=torch.Generator().manual_seed(1))
    assert dy.abs().sum() + dx.abs().sum() > 0
    idx = np.arange(224)
    for b in range(3):
        for v in range(2):  # view v of image b is row 2b + v of the offsets
            view = img[b, :, :, 224 * v : 224 * (v + 1)].numpy()
            rows = np.clip(idx + int(dy[2 * b + v]), 0, 223)
            cols = np.clip(idx + int(dx[2 * b + v]), 0, 223)
            want = view[:, rows][:, :, cols]
            np.testing.assert_array_equal(out[b, :, :, 224 * v : 224 * (v + 1)].numpy(), want)
    assert random_shift(img, 0, torch.Generator()) is img


def test_augmented_batches_shift_the_images_only() -> None:
    demos = [fake_demo(5, 25, 0), fake_demo(9, 14, 1)]
    plain, shifted = batches(demos), batches(demos, augment_shift=8)
    gen = torch.Generator().manual_seed(3)
    (o1, t1), (o2, t2) = (
        plain.actions(np.random.default_rng(0), 4),
        shifted.actions(np.random.default_rng(0), 4, gen),
    )
    torch.testing.assert_close(t1, t2)
    torch.testing.assert_close(o1.proprio, o2.proprio)
    torch.testing.assert_close(
        o2.image, random_shift(o1.image, 8, torch.Generator().manual_seed(3))
    )
    assert not torch.equal(o1.image, o2.image)


class _LineEnv:
    """A 1-D stand-in for LiberoEnv: position += executed x action; success past 1.0."""

    task = type("Task", (), {"index": 0})

    def __init__(self) -> None:
        self.x, self.executed = 0.0, []

    def reset(self, init_state: int) -> None:
        self.x, self.executed = 0.0, []

    def render(self) -> np.ndarray:
        return np.zeros((224, 448, 3), np.uint8)

    def proprio(self) -> np.ndarray:
        return np.full(8, self.x, np.float32)

    def step(self, action: np.ndarray, render: bool) -> bool:
        self.executed.append(action.copy())
        self.x += 0.1 * action[0]
        return self.x >= 1.0


class _Feedback:
    """Drives x toward 1.2 with gain 2 (a feedback expert, like the scripted ones)."""

    done = False

    def reset(self, env: _LineEnv) -> None:
        pass

    def act(self, env: _LineEnv) -> np.ndarray:
        return np.array([np.clip(2 * (1.2 - env.x), -1, 1), 0, 0, 0, 0, 0, 1.0])


def test_dart_noise_is_executed_but_not_recorded() -> None:
    from wamrl.demos import record

    env = _LineEnv()
    demo, steps = record(env, _Feedback(), 0, 100, 0.3, np.random.default_rng(7))
    assert demo is not None and steps == demo.length
    executed = np.stack(env.executed)
    noise = np.random.default_rng(7).normal(0.0, 0.3, (steps, 6))
    # the labels are the expert's answer to the state the noisy actions led to
    labels = np.clip(2 * (1.2 - demo.state[:, 0]), -1, 1)
    np.testing.assert_allclose(demo.action[:, 0], labels, atol=1e-6)
    np.testing.assert_allclose(
        executed[:, :6], np.clip(demo.action[:, :6] + noise, -1, 1), atol=1e-6
    )
    np.testing.assert_array_equal(executed[:, 6], 1.0)  # the gripper is never perturbed
    clean, _ = record(env, _Feedback(), 0, 100)
    assert clean is not None
    np.testing.assert_allclose(np.stack(env.executed)[:, 0], clean.action[:, 0], atol=1e-6)


def test_demo_attempts_start_at_first_init_state_and_split_over_workers() -> None:
    cfg = micro_cfg(
        {"demos.tasks": [0, 1], "demos.first_init_state": 10, "demos.init_states": 3,
         "demos.workers": 2},
    )  # fmt: skip
    both = [(t.index, i) for w in (0, 1) for t, i in attempts(cfg, w)]
    assert both == [(0, 10), (0, 11), (0, 12), (1, 10), (1, 11), (1, 12)]
    cfg["demos"]["first_init_state"] = 48  # LIBERO has 50: the range stops there
    assert [i for w in (0, 1) for _, i in attempts(cfg, w)] == [48, 49, 48, 49]
