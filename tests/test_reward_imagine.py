"""reward.reconstruction_rewards against its formula: r^rec = -mean((imagined - rendered)^2)
over both future frames in the model's [-1, 1] scale, 0 on padding, the same values
whatever the imagine batch (batches cross episodes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from wamrl.reward import imagine_batches, reconstruction_rewards

H, W = 4, 6  # small images: the function never assumes the contract's 224 x 448


class ShiftImagination:
    """imagine() = the query image shifted by the row's proprio[0] (a per-row value the test
    can predict), repeated for both futures; records each call's batch size."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def eval(self) -> None:
        pass

    def imagine(self, obs, num_future, steps, generator=None):  # type: ignore[no-untyped-def]
        self.calls.append(obs.image.shape[0])
        out = obs.image + obs.proprio[:, :1, None, None]
        return out[:, None].expand(-1, num_future, -1, -1, -1)


def _store(tmp_path, lengths: list[int], T: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    E = len(lengths)
    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    valid = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
    g.create_array("step/valid", data=valid)
    g.create_array("episode/task", data=np.arange(E, dtype=np.int64) % 2)
    g.create_array("step/image", data=rng.integers(0, 256, (E, T, H, W, 3), dtype=np.uint8))
    g.create_array("step/frames", data=rng.integers(0, 256, (E, T, 2, H, W, 3), dtype=np.uint8))
    g.create_array("step/proprio", data=rng.normal(size=(E, T, 8)).astype(np.float32) * 0.1)
    return g, valid


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_reconstruction_reward_is_minus_mse_of_both_futures(tmp_path, batch: int) -> None:
    g, valid = _store(tmp_path, lengths=[3, 0, 5, 1], T=6)
    policy = ShiftImagination()
    ctx, mask = torch.zeros(2, 5, 3), torch.ones(2, 5, dtype=torch.bool)
    r = reconstruction_rewards(policy, g, 0, ctx, mask, 4, 0, "cpu", batch=batch)  # type: ignore[arg-type]

    image = g["step/image"][:].astype(np.float64) * 2 / 255 - 1  # [E, T, H, W, 3]
    frames = g["step/frames"][:].astype(np.float64) * 2 / 255 - 1  # [E, T, 2, H, W, 3]
    shift = g["step/proprio"][:][..., 0].astype(np.float64)
    imagined = (image + shift[..., None, None, None])[:, :, None]  # both futures alike
    want = -((imagined - frames) ** 2).mean(axis=(2, 3, 4, 5))
    np.testing.assert_allclose(r[valid], want[valid], rtol=1e-5, atol=1e-6)
    assert (r[~valid] == 0).all()
    assert policy.calls == [min(batch, 9 - i) for i in range(0, 9, batch)]  # 9 valid steps


def test_imagine_batches_cross_episodes_in_order() -> None:
    valid = np.array([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=bool)
    got = [b.tolist() for b in imagine_batches(valid, 2)]
    assert got == [[[0, 0], [0, 1]], [[2, 0], [2, 1]], [[2, 2]]]


def test_imagination_progress_counts_every_batch_and_prints_to_a_log(tmp_path) -> None:
    from io import StringIO

    from rich.console import Console

    from wamrl.progress import progress_bar

    g, _ = _store(tmp_path, lengths=[3, 0, 5, 1], T=6)
    log = StringIO()  # not a terminal: the bar prints plain lines, as in a stage's log
    with progress_bar(console=Console(file=log, force_terminal=False)) as bar:
        ctx, mask = torch.zeros(2, 5, 3), torch.ones(2, 5, dtype=torch.bool)
        reconstruction_rewards(ShiftImagination(), g, 2, ctx, mask, 4, 0, "cpu", 2, bar)  # type: ignore[arg-type]
        (task,) = bar.tasks
    assert (task.completed, task.total) == (5, 5)  # 9 valid steps in batches of 2
    assert "reward imagination, shard 2: 5/5 9 steps" in log.getvalue()
