"""The whole DAG on the micro config: two iterations through Snakemake (marked `e2e`).

Checks what a user relies on: every output exists, iteration 2 rolled out with iteration 1's
merged checkpoint, eval.json follows the contract, and a forced rerun of iteration 1's
reward stage on the saved rollouts reproduces its arrays exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from wamrl import atomic, paths, store, store_check
from wamrl.atomic import sha256_file

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]


def snakemake(run: Path, *targets: str, flags: tuple[str, ...] = ()) -> None:
    cmd = [
        sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2",
        "--configfile", str(REPO / "tests" / "micro.yaml"),
        *flags, "--config", f"env={{mujoco_gl: {os.environ.get('MUJOCO_GL', 'egl')}}}",
        "--", *targets,
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=run, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]


def reward_arrays(run: Path) -> dict[str, np.ndarray]:
    out = {}
    for w in range(2):
        g = zarr.open_group(str(paths.shard_path(run, 1, w)), mode="r")
        for name in (*store.REWARD_NAMES, "group_kept"):
            out[f"{w}/{name}"] = np.asarray(g[f"reward/{name}"][:])
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("e2e")
    snakemake(run, "iter_002/eval.json")
    return run


def test_every_output_exists(run):
    assert (run / ".wamrl" / "config.yaml").is_file()
    assert (paths.policy_dir(run, 0) / "context.safetensors").is_file()
    for n in (1, 2):
        for w in range(2):
            assert store_check.validate_store(paths.shard_path(run, n, w), deep=True) == []
        assert paths.reward_done(run, n).is_file()
        assert (paths.actor_dir(run, n) / "metrics.json").is_file()
        assert (paths.world_model_dir(run, n) / "metrics.json").is_file()
        assert (paths.policy_dir(run, n) / "model.safetensors").is_file()
    assert paths.eval_json(run, 2).is_file()
    assert atomic.stale_under(run) == [], "a temporary artifact was left behind"


def test_iteration_2_rolls_out_iteration_1_checkpoint(run):
    sha1 = sha256_file(paths.policy_dir(run, 1) / "model.safetensors")
    sha0 = sha256_file(paths.policy_dir(run, 0) / "model.safetensors")
    assert sha1 != sha0, "the actor update changed nothing"
    for w in range(2):
        attrs = zarr.open_group(str(paths.shard_path(run, 2, w)), mode="r").attrs
        assert attrs["policy_sha256"] == sha1
        assert (run / attrs["policy_checkpoint"]).resolve() == paths.policy_dir(run, 1).resolve()
    merged = json.loads((paths.policy_dir(run, 1) / "checkpoint.json").read_text())
    assert merged["sha256"] == sha1


def test_eval_json(run):
    report = json.loads(paths.eval_json(run, 2).read_text())
    assert report["iteration"] == 2
    assert report["checkpoint_sha256"] == sha256_file(
        paths.policy_dir(run, 2) / "model.safetensors"
    )
    (name,) = report["tasks"]
    assert report["tasks"][name]["suite"] == "libero_spatial"
    assert report["tasks"][name]["episodes"] == 1
    assert report["average"] == report["tasks"][name]["success_rate"]
    assert report["config"]["pipeline"]["iterations"] == 2


def test_forced_reward_rerun_is_identical(run):
    before = reward_arrays(run)
    done = paths.reward_done(run, 1).read_text()
    snakemake(run, "iter_001/reward.done", flags=("-f",))
    after = reward_arrays(run)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
    assert (
        json.loads(paths.reward_done(run, 1).read_text())["groups_kept"]
        == json.loads(done)["groups_kept"]
    )


def test_plan_optimizer_and_every_artifact_check_out(run):
    """Iteration 2's plan came from iteration 1's rollouts (recorded in the store attrs),
    iteration 2's actor restored Adam's state, and `wamrl verify` passes the whole run."""
    from wamrl.plan import plan_from_attrs
    from wamrl.verify import verify_run

    for w in range(2):
        attrs = dict(zarr.open_group(str(paths.shard_path(run, 2, w)), mode="r").attrs)
        assert attrs["plan"]["source"] == [
            f"iter_001/rollouts/shard_{v:03d}.zarr" for v in range(2)
        ]
        assert sum(attrs["plan"]["episodes"]) == 4  # micro: 2 groups x G = 2 in iteration 1
        groups = zarr.open_group(str(paths.shard_path(run, 2, w)), mode="r")["episode/group"][:]
        assert sorted({s.group for s in plan_from_attrs(attrs, w)}) == sorted(set(groups.tolist()))
    metrics = json.loads((paths.actor_dir(run, 2) / "metrics.json").read_text())
    assert metrics["optimizer_reset"] is False and metrics["optimizer_state_restored_params"] > 0
    results = verify_run(run)
    assert len(results) > 20 and [r for r in results if r[1] is not None] == []
