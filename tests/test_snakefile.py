"""The DAG plans: `snakemake -n` on deep chains, and config errors stop it before any job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2"]


def plan(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SNAKEMAKE, "-n", *args], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )


def job_counts(out: str) -> dict[str, int]:
    counts = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and not parts[0].endswith(":"):
            counts[parts[0]] = int(parts[1])
    return counts


def test_one_iteration_plans_every_rule(tmp_path):
    p = plan(tmp_path, "iter_001/eval.json")
    assert p.returncode == 0, p.stderr
    counts = job_counts(p.stdout + p.stderr)
    assert counts == {
        "init": 1,
        "rollout": 2,
        "reward": 1,
        "actor": 1,
        "world_model": 1,
        "merge": 1,
        "eval": 1,
        "total": 8,
    }


def test_deep_chain_builds_without_recursion_error(tmp_path):
    p = plan(tmp_path, "iter_400/eval.json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert job_counts(p.stdout + p.stderr)["merge"] == 400


def test_all_evaluates_every_fifth_iteration(tmp_path):
    p = plan(tmp_path, "all", "--config", "pipeline={iterations: 12}")
    assert p.returncode == 0, p.stderr
    assert job_counts(p.stdout + p.stderr)["eval"] == 3  # 5, 10 and the last, 12


def test_config_error_stops_before_any_job(tmp_path):
    p = plan(tmp_path, "iter_001/eval.json", "--config", "actor={lr: -1}")
    assert p.returncode != 0
    assert "actor.lr" in p.stdout + p.stderr
    assert not (tmp_path / "iter_000").exists()
