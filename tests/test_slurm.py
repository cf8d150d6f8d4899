"""The micro config's two iterations through a real SLURM, with profiles/slurm (marked `slurm`).

Needs a cluster that answers `sinfo` (`bash scripts/slurm_local.sh up` makes one on this host)
and snakemake-executor-plugin-slurm (`pip install -e ".[cluster]"`); skipped otherwise. Every
stage runs as its own sbatch job; the checks are test_e2e's.

The profile is used as written, with what a single small node needs on top, in a copy:
- no GPUs in the cluster: `gpu: 0` (the stages run on CPU, as the micro config says);
- every mem_mb and cpus_per_task request capped at the node's (the profile's figures are
  full-size ones; SLURM never starts a job that asks for more than a node has);
- job states from squeue (a localhost cluster has no accounting database for sacct), checked
  every few seconds instead of the plugin's 40 s first wait.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_e2e import (  # the same checks as the local end-to-end run
    reward_arrays,
    test_eval_json,  # noqa: F401
    test_every_output_exists,  # noqa: F401
    test_iteration_2_rolls_out_iteration_1_checkpoint,  # noqa: F401
)

from wamrl import paths

REPO = Path(__file__).resolve().parents[1]


def _sinfo(fmt: str) -> str | None:
    if shutil.which("sinfo") is None:
        return None
    try:
        p = subprocess.run(["sinfo", "-h", "-o", fmt], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 and p.stdout.strip() else None


def _why_skip() -> str | None:
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return 'snakemake-executor-plugin-slurm missing (pip install -e ".[cluster]")'
    if _sinfo("%P") is None:
        return "no SLURM answers sinfo (bash scripts/slurm_local.sh up)"
    return None


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or ""),
]


def local_profile(dest: Path) -> Path:
    """profiles/slurm/config.yaml, fitted to the cluster sinfo describes (see the docstring)."""
    cfg = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    node_mem = min(int(m.rstrip("+")) for m in _sinfo("%m").split())
    node_cpus = min(int(c.rstrip("+")) for c in _sinfo("%c").split())
    has_gpus = "gpu" in (_sinfo("%G") or "")
    for res in [cfg["default-resources"], *cfg["set-resources"].values()]:
        if "mem_mb" in res:
            res["mem_mb"] = f"min({res['mem_mb']}, {node_mem})"
        if "cpus_per_task" in res:
            res["cpus_per_task"] = f"min({res['cpus_per_task']}, {node_cpus})"
        if not has_gpus and "gpu" in res:
            res["gpu"] = 0
    if not has_gpus:
        # The actor's gpu comes from the Snakefile; on CPU (device: cpu) it is 0 already.
        cfg["set-resources"].setdefault("actor", {})["gpu"] = 0
    cfg["slurm-status-command"] = "squeue"
    cfg["slurm-init-seconds-before-status-checks"] = 2
    cfg["slurm-keep-successful-logs"] = True
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dest


def snakemake(run: Path, *targets: str, flags: tuple[str, ...] = ()) -> None:
    cmd = [
        sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"),
        "--profile", str(local_profile(run.parent / f"{run.name}-profile")),
        "--configfile", str(REPO / "tests" / "micro.yaml"),
        *flags, "--config", f"env={{mujoco_gl: {os.environ.get('MUJOCO_GL', 'egl')}}}",
        "--", *targets,
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=run, capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-6000:]
    # Every stage really went through sbatch, none ran in this process.
    assert "has been submitted with SLURM jobid" in p.stderr, p.stderr[-3000:]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("slurm")
    snakemake(run, "iter_002/eval.json")
    return run


def test_every_stage_ran_as_a_slurm_job(run):
    logs = list((run / ".snakemake" / "slurm_logs").rglob("*.log"))
    rules = {part[5:] for p in logs for part in p.parts if part.startswith("rule_")}
    assert {"init", "rollout", "reward", "actor", "world_model", "merge", "eval"} <= rules, rules


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
