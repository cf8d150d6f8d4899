"""demos -> sft -> init on real LIBERO (CPU, tiny settings): the base the default starts from.

One scripted-expert episode of an easy pick-and-place task is recorded through the demos
stage; the store is read back against the env's own conventions; SFT runs a few steps on
it; init then starts iteration 0 from that checkpoint with its statistics.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zarr

from tests.helpers import micro_cfg
from wamrl import paths

pytestmark = pytest.mark.libero
TASK = 10  # libero_object 0: pick up the alphabet soup and place it in the basket


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    import stages.demos
    import stages.init
    import stages.sft

    cfg = micro_cfg(
        {
            "demos.workers": 1,
            "demos.init_states": 1,
            "demos.tasks": [TASK],
            "sft.steps": 3,
            "sft.save_every": 2,
            "sft.batch": 2,
            "sft.video_batch": 1,
            "policy.base_checkpoint": "sft",
            "env.mujoco_gl": os.environ.get("MUJOCO_GL", "egl"),
        },
    )
    run = tmp_path_factory.mktemp("sft")
    stages.demos.main(cfg, run, worker=0)
    stages.sft.main(cfg, run)
    stages.init.main(cfg, run)
    return run, cfg


def test_demo_store_holds_the_expert_episode(sft_run):
    from wamrl.demos import load_demos, n_frames, n_queries

    run, _ = sft_run
    store = run / "demos" / "shard_000.zarr"
    root = zarr.open_group(str(store), mode="r")
    (attempt,) = root.attrs["attempts"]
    assert attempt["task"] == TASK and attempt["success"], "the expert must solve this task"
    demos = load_demos([store])
    L = int(demos.length[0])
    assert attempt["steps"] == L and 10 < L <= 300
    assert demos.images[0].shape == (n_queries(L), 224, 448, 3)
    assert demos.frames[0].shape == (n_frames(L), 224, 448, 3)
    assert demos.images[0].std() > 10  # rendered scenes, not blank frames
    np.testing.assert_array_equal(demos.images[0][0], demos.frames[0][0])  # both are step 0
    assert np.isin(demos.action[0][:, -1], [0.0, 1.0]).all()  # data gripper convention
    assert np.abs(demos.action[0][:, :6]).max() <= 1.0


def test_sft_checkpoint_is_the_init_base(sft_run):
    from wamrl.atomic import sha256_file

    run, _ = sft_run
    sft_dir = run / "sft" / "policy"
    stats = json.loads((sft_dir / "stats.json").read_text())
    assert "expert demonstrations" in stats["source"]
    log = json.loads((run / "sft" / "log.json").read_text())
    assert len(log["log"]) >= 1 and np.isfinite(log["log"][-1]["action_loss"])
    base = paths.policy_dir(run, 0)
    assert sha256_file(base / "model.safetensors") == sha256_file(sft_dir / "model.safetensors")
    assert json.loads((base / "stats.json").read_text()) == stats
    meta = json.loads((base / "checkpoint.json").read_text())
    assert meta["base_checkpoint"] == str(sft_dir)
    assert json.loads((sft_dir / "checkpoint.json").read_text())["sft_steps"] == 3
    assert not (run / "sft" / "snapshot").exists()  # the step-2 snapshot was superseded
