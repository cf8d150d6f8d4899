"""scripts/grad_snr.py's pieces against hand numbers: success-only advantages normalised
within each group, run-wide group ids, and the cosine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.stores import make_episode, write_store
from wamrl.ppo import ActorData

_spec = importlib.util.spec_from_file_location(
    "grad_snr", Path(__file__).parents[1] / "scripts" / "grad_snr.py"
)
grad_snr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grad_snr)


def _steps(where: list[tuple[int, int, int]]) -> ActorData:
    n = len(where)
    return ActorData(
        image=np.zeros((n, 1, 1, 3), np.uint8), proprio=np.zeros((n, 8), np.float32),
        task=np.zeros(n, np.int64), x_k=np.zeros((n, 1), np.float32),
        x_next=np.zeros((n, 1), np.float32), k_star=np.ones(n, np.int64),
        logp_old=np.zeros(n, np.float32), adv=np.zeros(n, np.float32),
        where=np.array(where, np.int64), context=torch.zeros(1), context_mask=torch.zeros(1),
        K=4, noise_a=0.5, shift=5.0,
    )  # fmt: skip


def test_success_advantage_and_groups_by_hand(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    # G = 2 (the stores' attrs): shard 0 = groups (success, fail), (fail, fail);
    # shard 1 = groups (success, success), (fail, success)
    outcomes = [[(0, True), (0, False), (1, False), (1, False)],
                [(0, True), (0, True), (1, False), (1, True)]]  # fmt: skip
    shards = [
        write_store(tmp_path / f"s{w}.zarr", [make_episode(rng, 2, s, group=g) for g, s in eps])
        for w, eps in enumerate(outcomes)
    ]
    # one step of each episode, (shard, episode, step), in another order than stored
    where = [(w, e, 1) for w in (1, 0) for e in (3, 0, 1, 2)]
    adv = grad_snr.success_advantage(_steps(where), grad_snr.episode_tables(shards), G=2)
    # within a group: (s - mean) / std = +-1 where the two differ, 0 where they agree
    expected = {(0, 0): 1, (0, 1): -1, (0, 2): 0, (0, 3): 0,
                (1, 0): 0, (1, 1): 0, (1, 2): -1, (1, 3): 1}  # fmt: skip
    np.testing.assert_allclose(adv, [expected[w, e] for w, e, _ in where], atol=1e-5)
    group = grad_snr.group_of(_steps(where), grad_snr.episode_tables(shards))
    # 4 groups run-wide: group 0 of shard 0 is not group 0 of shard 1
    assert len(set(group.tolist())) == 4
    assert group[where.index((1, 0, 1))] == group[where.index((1, 1, 1))]


def test_cosine() -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])
    assert grad_snr.cosine(a, b) == pytest.approx(1 / np.sqrt(2))
    assert grad_snr.cosine(a, -a) == pytest.approx(-1.0)
