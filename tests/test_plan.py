"""The rollout plan (wamrl.plan): rates only from iteration n-1's rollout stores, recorded in
the store attrs and recomputable from them; eval.json plays no part."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.stores import TV, K, T, make_episode, store_attrs
from wamrl import paths
from wamrl.config import load_config
from wamrl.envs.tasks import tasks_in_suites
from wamrl.plan import (
    make_plan,
    plan_from_attrs,
    previous_rollout_counts,
    rollout_plan,
    rollout_tasks,
    shard_specs,
    smoothed_rates,
    systematic_draw,
    task_weights,
)
from wamrl.store import EpisodeData, ShardWriter, StoreError


def _cfg(**rollout) -> dict:
    return load_config(
        overrides={"rollout": {"workers": 2, "groups": 8, "group_size": 2, **rollout}}
    )


def _write(path: Path, episodes: list[tuple[int, bool, bool]]) -> None:
    """A store whose episodes have the given (task, success, env_crashed)."""
    rng = np.random.default_rng(0)
    eps: list[EpisodeData] = []
    for i, (task, success, crashed) in enumerate(episodes):
        ep = make_episode(rng, 0 if crashed else 1, success and not crashed, group=i)
        ep.task, ep.env_crashed = task, crashed
        eps.append(ep)
    with ShardWriter(path, len(eps), T, K, TV, store_attrs()) as w:
        for i, ep in enumerate(eps):
            w.write_episode(i, ep)


def test_smoothed_rates_and_weights_by_number() -> None:
    np.testing.assert_allclose(smoothed_rates([3, 0, 0], [4, 0, 1]), [3.5 / 5, 0.5, 0.25])
    # w ∝ exp(t (1 - rate)): rates 0.75 and 0.25 at t = 2 -> exp(0.5) : exp(1.5)
    w = task_weights(np.array([0.75, 0.25]), 2.0)
    np.testing.assert_allclose(w, [1 / (1 + np.e), np.e / (1 + np.e)])


def test_rates_come_from_the_previous_rollouts_and_eval_json_changes_nothing(
    tmp_path: Path,
) -> None:
    cfg = _cfg(oversample_temperature=3.0)
    tasks = tasks_in_suites(cfg["rollout"]["suites"])
    run = tmp_path
    # iteration 1 reads no store: every rate 0.5, uniform weights
    specs1, rec1 = make_plan(cfg, run, 1, tasks)
    assert rec1["source"] == [] and set(rec1["rates"]) == {0.5}
    # iteration 1's rollouts: task 0 succeeded 3/3, task 1 failed 2/2, task 2 crashed only
    _write(paths.shard_path(run, 1, 0), [(0, True, False), (0, True, False), (1, False, False)])
    _write(paths.shard_path(run, 1, 1), [(0, True, False), (1, False, False), (2, True, True)])
    succ, n, src = previous_rollout_counts(run, 2, tasks, 2)
    assert src == ["iter_001/rollouts/shard_000.zarr", "iter_001/rollouts/shard_001.zarr"]
    assert (succ[:3].tolist(), n[:3].tolist()) == ([3, 0, 0], [3, 2, 0])
    specs, rec = make_plan(cfg, run, 2, tasks)
    assert rec["rates"][:3] == pytest.approx([3.5 / 4, 0.5 / 3, 0.5])
    assert rec["temperature"] == 3.0 and rec["episodes"][:3] == [3, 2, 0]

    # an eval.json of any earlier iteration does not move the plan
    for it in (0, 1):
        paths.eval_json(run, it).parent.mkdir(parents=True, exist_ok=True)
        paths.eval_json(run, it).write_text(
            json.dumps({"tasks": {t.name: {"success_rate": 1.0} for t in tasks}})
        )
    again, rec_again = make_plan(cfg, run, 2, tasks)
    assert again == specs and rec_again == rec
    # while the rates do: the same config with uniform rates draws another plan
    assert rollout_plan(cfg, 2, tasks, np.full(len(tasks), 0.5)) != specs


def test_plan_recomputed_from_the_store_attrs_equals_the_plan_used(tmp_path: Path) -> None:
    cfg = _cfg(oversample_temperature=2.0)
    tasks = tasks_in_suites(cfg["rollout"]["suites"])
    _write(paths.shard_path(tmp_path, 4, 0), [(5, True, False), (6, False, False)])
    _write(paths.shard_path(tmp_path, 4, 1), [(5, True, False)])
    specs, record = make_plan(cfg, tmp_path, 5, tasks)
    attrs = json.loads(json.dumps({"plan": record}))  # as a store's attrs hold it
    assert plan_from_attrs(attrs) == specs
    for w in (0, 1):
        assert plan_from_attrs(attrs, worker=w) == shard_specs(specs, w, 2)
    # every episode has its own noise seed, all different
    seeds = [s.noise_seed for s in specs]
    assert None not in seeds and len(set(seeds)) == len(seeds)


def test_rollout_tasks_restricts_the_plan_and_its_replan(tmp_path: Path) -> None:
    cfg = _cfg(suites=["libero_object"], tasks=[13, 17])
    tasks = rollout_tasks(cfg)
    assert [t.index for t in tasks] == [13, 17]
    assert len(rollout_tasks(_cfg(suites=["libero_object"]))) == 10  # null: the whole suite
    specs, record = make_plan(cfg, tmp_path, 1, tasks)
    assert record["tasks"] == [13, 17]
    assert sorted({s.task.index for s in specs}) == [13, 17]  # 8 groups over two tasks
    attrs = json.loads(json.dumps({"plan": record}))
    assert plan_from_attrs(attrs) == specs


def test_a_missing_or_half_written_previous_store_is_named(tmp_path: Path) -> None:
    cfg = _cfg()
    tasks = tasks_in_suites(cfg["rollout"]["suites"])
    _write(paths.shard_path(tmp_path, 1, 0), [(0, True, False)])
    with pytest.raises(StoreError, match="shard_001.zarr"):
        make_plan(cfg, tmp_path, 2, tasks)
    _write(paths.shard_path(tmp_path, 1, 1), [(0, True, False)])
    import zarr

    zarr.open_group(str(paths.shard_path(tmp_path, 1, 1)), mode="r+").attrs["complete"] = False
    with pytest.raises(StoreError, match="shard_001.zarr: store is half-written"):
        make_plan(cfg, tmp_path, 2, tasks)


def test_the_rollout_rule_declares_the_previous_rollouts(tmp_path: Path) -> None:
    """The plan's inputs are the DAG's: rollout n lists iteration n-1's shards (iteration 1
    only the base policy); no eval.json is an input."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "snakemake", "-s", str(repo / "Snakefile"), "-n", "--cores",
           "1", "--", "iter_002/rollouts/shard_000.zarr"]  # fmt: skip
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    inputs = {
        line.split("output: ")[1]: prev.split("input: ")[1]
        for prev, line in zip(p.stdout.splitlines(), p.stdout.splitlines()[1:], strict=False)
        if "output: " in line and "rollouts/shard_" in line
    }
    assert inputs["iter_001/rollouts/shard_000.zarr"] == "iter_000/policy"
    assert inputs["iter_002/rollouts/shard_000.zarr"] == (
        "iter_001/policy, iter_001/rollouts/shard_000.zarr, iter_001/rollouts/shard_001.zarr"
    )


def test_systematic_draw_holds_each_task_floor_or_ceil_of_its_share() -> None:
    rng = np.random.default_rng(3)
    # uniform weights, n = number of tasks: every task exactly once, in a shuffled order
    picks = systematic_draw(np.full(10, 0.1), 10, rng)
    assert sorted(picks) == list(range(10)) and picks != list(range(10))
    # n w = [3.2, 1.6, 0.8, 0.4]: counts 3 or 4, 1 or 2, 0 or 1, 0 or 1; 6 picks in all
    w = np.array([0.4, 0.2, 0.1, 0.05]) / 0.75
    for _ in range(50):
        counts = np.bincount(systematic_draw(w, 6, rng), minlength=4)
        assert counts.sum() == 6
        assert all(np.floor(6 * w) <= counts) and all(counts <= np.ceil(6 * w))


def test_the_plan_draws_every_task_once_at_uniform_weights_and_old_stores_replan() -> None:
    cfg = _cfg(oversample_temperature=0.0, groups=10)
    tasks = tasks_in_suites(["libero_object"])
    rates = np.full(len(tasks), 0.5)
    specs = rollout_plan(cfg, 4, tasks, rates)
    assert sorted({s.task.index for s in specs}) == [t.index for t in tasks]
    # the independent draw (stores without attrs.plan.draw) repeats tasks at this seed
    old = rollout_plan(cfg, 4, tasks, rates, draw="independent")
    assert len({s.task.index for s in old}) < len(tasks)
    _, record = make_plan(cfg, Path("/nonexistent"), 1, tasks)
    record.pop("draw")
    assert plan_from_attrs({"plan": record}) == rollout_plan(cfg, 1, tasks, rates, "independent")
    with pytest.raises(ValueError, match="unknown task draw"):
        rollout_plan(cfg, 4, tasks, rates, draw="stratified")
