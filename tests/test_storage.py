"""The micro config's two iterations under a Snakemake storage provider (marked `e2e`).

What profiles/kubernetes relies on, run locally: `--default-storage-provider fs` with a local
folder as the storage prefix and the local executor. Every job then works on local copies of
its declared inputs (under .snakemake/storage/) and only its declared outputs are uploaded,
so a stage that read an undeclared file, or wrote into an input, fails or loses its result
here. The checks are test_e2e's, on the storage prefix; the working directory keeps no
artifact. Skipped without snakemake-storage-plugin-fs (`pip install -e ".[cluster]"`) or the
rsync it copies with.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_e2e import (  # the same checks as the plain end-to-end run, on the storage prefix
    reward_arrays,
    test_eval_json,  # noqa: F401
    test_every_output_exists,  # noqa: F401
    test_iteration_2_rolls_out_iteration_1_checkpoint,  # noqa: F401
    test_plan_optimizer_and_every_artifact_check_out,  # noqa: F401
)

from wamrl import paths


def _why_skip() -> str | None:
    if importlib.util.find_spec("snakemake_storage_plugin_fs") is None:
        return 'snakemake-storage-plugin-fs missing (pip install -e ".[cluster]")'
    if shutil.which("rsync") is None:
        return "rsync missing (the fs storage plugin copies with it)"
    return None


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or ""),
]
REPO = Path(__file__).resolve().parents[1]


def snakemake(work: Path, store: Path, *targets: str, flags: tuple[str, ...] = ()) -> str:
    cmd = [
        sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2",
        "--default-storage-provider", "fs", "--default-storage-prefix", str(store),
        "--configfile", str(REPO / "tests" / "micro.yaml"),
        *flags, "--config", f"env={{mujoco_gl: {os.environ.get('MUJOCO_GL', 'egl')}}}",
        "--", *targets,
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stderr


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Where Snakemake runs; the run itself lands in the storage prefix beside it."""
    work = tmp_path_factory.mktemp("storage") / "work"
    work.mkdir()
    snakemake(work, work.parent / "store", "iter_002/eval.json")
    return work


@pytest.fixture(scope="module")
def run(work) -> Path:
    """The run dir the e2e checks read: the storage prefix."""
    return work.parent / "store"


def test_artifacts_live_in_storage_only(work, run):
    assert (run / "logs" / "iter_001" / "reward.log").is_file()
    local = {p.name for p in work.iterdir()}
    assert local <= {".snakemake", ".wamrl"}, local  # the recorded config, and the state
    assert (work / ".wamrl" / "config.yaml").read_text() == (run / ".wamrl/config.yaml").read_text()


def test_forced_reward_rerun_restores_the_stored_reward_groups(work, run):
    """reward/ lives inside the shards, the reward rule's inputs: its rule uploads it. With
    the stored groups deleted, a forced rerun puts back the same arrays."""
    before = reward_arrays(run)
    for shard in paths.shard_paths(run, 1, 2):
        shutil.rmtree(shard / "reward")
    snakemake(work, run, "iter_001/reward.done", flags=("-f",))
    after = reward_arrays(run)
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)
