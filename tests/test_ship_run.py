"""scripts/ship_run.sh: a run's small artifacts (and nothing else) into a shipped folder with its
report; bad input is refused before anything is written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SHIPPED = ROOT / "data" / "rl_object_v9"  # a shipped run stands in for a run's metadata


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / ".wamrl").mkdir(parents=True)
    shutil.copy(SHIPPED / "config.yaml", run / ".wamrl" / "config.yaml")
    for it in ("iter_000", "iter_001", "iter_003"):
        shutil.copytree(SHIPPED / it, run / it)
    (run / "iter_001" / "rollouts" / "shard_000.zarr").mkdir(parents=True)
    (run / "iter_001" / "rollouts" / "shard_000.zarr" / "zarr.json").write_text("{}")
    (run / "iter_001" / "policy").mkdir()
    (run / "iter_001" / "policy" / "model.safetensors").write_bytes(b"x")
    (run / "logs").mkdir()
    return run


def _ship(*args: Path | str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "ship_run.sh"), *map(str, args)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )  # fmt: skip


def test_ships_metrics_and_evals_and_a_report(tmp_path: Path) -> None:
    run, dest = _run_dir(tmp_path), tmp_path / "ship"
    extra = tmp_path / "extra.yaml"
    extra.write_text("seed: 2\n")
    r = _ship(run, dest, extra)
    assert r.returncode == 0, r.stderr
    shipped = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    data = {p for p in shipped if not p.startswith("report/")}
    assert data == {
        "config.yaml", "extra.yaml", "iter_000/eval.json",
        "iter_001/actor/metrics.json", "iter_001/world_model/metrics.json",
        "iter_001/reward.done", "iter_003/actor/metrics.json",
        "iter_003/world_model/metrics.json", "iter_003/reward.done", "iter_003/eval.json",
    }  # fmt: skip
    assert {"report/index.html", "report/learning_curves.png"} <= shipped
    for f in data - {"extra.yaml"}:
        src = run / ".wamrl" / f if f == "config.yaml" else run / f
        assert (dest / f).read_bytes() == src.read_bytes(), f


@pytest.mark.parametrize("bad", ["not_a_run", "dest_not_empty", "no_extra"])
def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path, bad: str) -> None:
    run, dest = _run_dir(tmp_path), tmp_path / "ship"
    args: list[Path | str] = [run, dest]
    if bad == "not_a_run":
        args[0] = tmp_path / "iter_000"
    elif bad == "dest_not_empty":
        dest.mkdir()
        (dest / "README.md").write_text("an earlier ship")
    else:
        args.append(tmp_path / "missing.yaml")
    r = _ship(*args, NO_REPORT="1")
    assert r.returncode == 2 and "ship_run:" in r.stderr
    left = sorted(p.name for p in dest.rglob("*")) if dest.exists() else []
    assert left == (["README.md"] if bad == "dest_not_empty" else [])


def test_git_keeps_shipped_iterations_and_ignores_run_dirs() -> None:
    """A run's iter_NNN/ folders are ignored (a run in the checkout stays out of commits),
    except under data/, where ship_run.sh puts what is shipped on purpose: an ignore rule that
    caught those too once left two shipped runs without their metrics and evals."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")

    def ignored(path: str) -> bool:
        r = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT, timeout=30)
        return r.returncode == 0

    assert ignored("iter_001/policy/model.safetensors")
    assert ignored("some/run/iter_012/eval.json")
    assert not ignored("data/rl_object_v10/iter_008/eval.json")
    assert not ignored("data/rl_ketchup_cpu/rerun_seed2/recipe/iter_001/reward.done")
