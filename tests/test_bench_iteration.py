"""bench/bench_iteration.py's pure parts: the DAG order, the commands, the breakdown and
ratio arithmetic; and wamrl/timing.py's recorder (off without WAMRL_TIMING)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from wamrl import timing

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_iteration", REPO / "bench" / "bench_iteration.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_iteration"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_dag_levels_follow_the_snakefile(bench):
    levels = bench.dag_levels(2)
    assert levels == [
        [("rollout", 0), ("rollout", 1)],
        [("reward", None)],
        [("actor", None), ("world_model", None)],
        [("merge", None)],
        [("eval", None)],
    ]
    flat = bench.dag_levels(2, sequential=True)
    assert all(len(level) == 1 for level in flat)
    assert [job for level in flat for job in level] == [job for level in levels for job in level]


def test_commands_are_the_snakefiles(bench):
    assert bench.command("rollout", 1, 0) == [
        "rollout",
        "--iter",
        "001",
        "--worker",
        "000",
        "--run-dir",
        ".",
    ]
    assert bench.command("world_model", 3, None) == [
        "world-model",
        "--iter",
        "003",
        "--run-dir",
        ".",
    ]
    assert bench.command("init", 0, None) == ["init", "--run-dir", "."]
    assert bench.job_name("rollout", 1) == "rollout_001"
    assert bench.job_name("eval", None) == "eval"


def env_record(**seconds):
    counts = {"render": 4, "reset": 2, "step": 20}
    marks = {"worker_start": 100.0, "imported": 103.0}
    return {
        "phases": {k: {"s": v, "n": counts.get(k, 1)} for k, v in seconds.items()},
        "marks": marks,
    }


def test_env_breakdown_takes_the_reset_renders_out_of_the_steps(bench):
    rec = env_record(
        env_build=2.0, reset=3.0, step=10.0, render=4.0, image=0.5, wait=6.0, tail_idle=1.0
    )
    b = bench.env_breakdown(rec)
    # 4 renders of 1 s: 2 inside the resets, 2 inside the steps
    assert b["imp"] == pytest.approx(3.0)
    assert b["reset"] == pytest.approx(1.0)
    assert b["step"] == pytest.approx(8.0)
    assert b["render"] == pytest.approx(4.5)
    assert b["query"] == 6.0 and b["tail"] == 1.0 and b["build"] == 2.0
    assert b["physics"] == pytest.approx(13.0)  # reset + step, renders included
    # exclusive parts add up to the inclusive time
    assert b["reset"] + b["step"] + b["render"] - 0.5 == pytest.approx(b["physics"])
    assert b["reset_first"] == 0.0  # a record written before first intervals were kept
    rec["phases"]["reset"]["first"] = 2.5
    assert bench.env_breakdown(rec)["reset_first"] == 2.5


def test_mean_env_and_physics_floor(bench):
    a = bench.mean_env(
        [env_record(reset=2.0, step=8.0, render=4.0), env_record(reset=1.0, step=4.0, render=4.0)]
    )
    assert a["physics"] == pytest.approx(7.5)
    assert a["physics_max"] == pytest.approx(10.0)
    assert a["processes"] == 2 and a["env_steps"] == 40
    b = {"physics_max": 3.0}
    # together: the busiest process of any pool; in sequence: they add up
    assert bench.physics_floor([[a, b]]) == pytest.approx(10.0)
    assert bench.physics_floor([[a], [b]]) == pytest.approx(13.0)
    # without the renders (1 s each, 4 per process): 10 - 4 and 5 - 4
    assert a["physics_no_render_max"] == pytest.approx(6.0)
    assert bench.physics_floor([[a]], "physics_no_render_max") == pytest.approx(6.0)
    assert bench.mean_env([]) == {}
    assert bench.ratio(30.0, 10.0) == 3.0
    assert math.isnan(bench.ratio(1.0, 0.0))


def test_stage_breakdown(bench):
    rec = {
        "stage": "rollout",
        "marks": {"launch": 0.0, "interpreter": 0.2, "main_start": 5.0, "main_end": 25.0},
        "phases": {
            "pool_start": {"s": 0.5, "n": 1},
            "policy_load": {"s": 1.0, "n": 1},
            "episodes": {"s": 15.0, "n": 1},
            "store_write_inner": {"s": 2.0, "n": 4},
            "store_open": {"s": 0.25, "n": 1},
            "store_close": {"s": 0.75, "n": 1},
            "pool_close": {"s": 1.5, "n": 1},
        },
    }
    b = bench.stage_breakdown(rec, exit_time=26.0)
    assert b["wall"] == 26.0 and b["start"] == 5.0 and b["main"] == 20.0 and b["exit"] == 1.0
    assert b["interp"] == pytest.approx(0.2)
    assert b["loop"] == 13.0  # the episode loop, its store writes taken out
    assert b["store"] == 3.0
    assert b["pool"] == 2.0 and b["load"] == 1.0 and b["learn"] == 0.0
    assert b["other"] == pytest.approx(20.0 - (0.5 + 1.0 + 15.0 + 0.25 + 0.75 + 1.5))
    learner = {
        "stage": "reward",
        "marks": {"launch": 0.0, "interpreter": 0.1, "main_start": 4.0, "main_end": 10.0},
        "phases": {"compute": {"s": 5.0, "n": 1}, "store_write_inner": {"s": 1.0, "n": 2}},
    }
    b = bench.stage_breakdown(learner, exit_time=10.5)
    assert b["learn"] == 4.0 and b["store"] == 1.0 and b["other"] == pytest.approx(1.0)


def test_overheads_add_each_jobs_figures(bench):
    job = {
        "start": 3.0,
        "exit": 1.0,
        "load": 0.5,
        "read": 0.0,
        "store": 0.2,
        "learn": 0.0,
        "pool": 0.1,
        "other": 0.3,
    }
    over = bench.overheads(
        {"a": {**job, "env": {"imp": 2.0, "build": 1.0, "query": 4.0, "tail": 0.5}}, "b": job}
    )
    assert over["process start + imports"] == 8.0
    assert over["env spawn + imports"] == 2.0 and over["env builds"] == 1.0
    assert over["env waiting for queries"] == 4.0


def test_timing_is_off_without_the_env_var(monkeypatch, tmp_path):
    monkeypatch.delenv(timing.ENV, raising=False)
    before = dict(timing.phases().seconds)

    @timing.timed("t_off")
    def f(x):
        return x + 1

    assert f(1) == 2
    with timing.phase("t_off_block"):
        pass
    assert timing.phases().seconds == before
    assert timing.write("x") is None


def test_timing_records_and_writes(monkeypatch, tmp_path):
    monkeypatch.setenv(timing.ENV, str(tmp_path))
    rec = timing.phases()

    @timing.timed("t_on")
    def f():
        return 7

    assert f() == 7 and f() == 7
    with timing.phase("t_wait"):
        pass
    with timing.phase("t_wait"):
        pass
    timing.relabel_last("t_wait", "t_tail")
    timing.mark("t_mark")
    assert rec.counts["t_on"] == 2 and rec.counts["t_wait"] == 1 and rec.counts["t_tail"] == 1
    path = timing.write("unit", {"extra": 1})
    data = json.loads(path.read_text())
    assert data["kind"] == "unit" and data["extra"] == 1 and "t_mark" in data["marks"]
    assert data["phases"]["t_on"]["n"] == 2
    assert [r["kind"] for r in timing.read_all(tmp_path, "unit")] == ["unit"]


def test_phases_relabel_last():
    p = timing.Phases()
    p.add("wait", 1.0)
    p.add("wait", 3.0)
    p.relabel_last("wait", "tail")
    assert p.seconds == {"wait": 1.0, "tail": 3.0} and p.counts == {"wait": 1, "tail": 1}
    p.relabel_last("missing", "tail")  # nothing to move
    assert p.counts["tail"] == 1


def test_phases_keep_each_phases_first_interval():
    p = timing.Phases()
    p.add("reset", 5.0)  # a cold first reset
    p.add("reset", 1.0)
    p.add("wait", 2.0)
    p.relabel_last("wait", "tail")  # wait's only interval moves: it has no first any more
    d = p.as_dict()["phases"]
    assert d["reset"] == {"s": 6.0, "n": 2, "first": 5.0}
    assert d["tail"]["first"] == 2.0 and d["wait"]["first"] == 0.0


def test_spawn_and_imports(bench):
    rec = env_record(env_build=5.0, **{"import": 2.0})
    b = bench.env_breakdown(rec, spawned_at=99.0)
    assert b["spawn"] == pytest.approx(1.0)  # pool start to the worker's first line
    assert b["imp"] == pytest.approx(5.0)  # its own imports + robosuite/LIBERO in the first build
    assert b["build"] == pytest.approx(3.0)
    assert bench.env_breakdown(rec)["spawn"] == 0.0


@pytest.mark.e2e
@pytest.mark.libero
def test_bench_runs_one_micro_iteration_and_keeps_every_env_record(tmp_path):
    """The whole benchmark on tests/micro.yaml: every job of the iteration and both env-only
    pools are timed, each env process's own record is kept beside the means, and the
    closing ratio is the iteration's wall over its physics."""
    import os
    import subprocess

    out = tmp_path / "bi.json"
    gl = os.environ.get("MUJOCO_GL", "egl")
    cmd = [sys.executable, str(REPO / "bench" / "bench_iteration.py"), "--config",
           str(REPO / "tests" / "micro.yaml"), "--set", f"env.mujoco_gl={gl}",
           "--run-dir", str(tmp_path / "run"), "--json", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=tmp_path, capture_output=True, timeout=600)
    fig = json.loads(out.read_text())
    jobs = fig["jobs"]
    stages = ["init", "rollout_000", "rollout_001", "reward", "actor", "world_model", "merge"]
    assert set(jobs) == {*stages, "eval"}
    for name in ["rollout_000", "rollout_001", "eval"]:  # micro.yaml: one env per pool
        recs = jobs[name]["env_records"]
        assert len(recs) == jobs[name]["env"]["processes"] == 1
        assert recs[0]["phases"]["reset"]["n"] >= 1
        assert 0 < jobs[name]["env"]["reset_first"] == recs[0]["phases"]["reset"]["first"]
    for pool in fig["env_only"].values():
        assert len(pool["env_records"]) == pool["env"]["processes"]
    s = fig["summary"]
    assert s["ratio"] == pytest.approx(s["iteration_wall"] / s["env_physics"])
    assert s["env_physics"] == pytest.approx(s["physics_rollout"] + s["physics_eval"])
