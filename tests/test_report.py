"""`wamrl report` (wamrl.report) and the stages' TensorBoard scalars (wamrl.tb).

Runs on the shipped real run's small artifacts (data/rl_object: no stores), on hand-made
half-finished run dirs, and on the learner tests' synthetic stores (episode videos, the
reward stage's scalars).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from stages.cli import app
from wamrl import tb
from wamrl.compare import two_proportion_z
from wamrl.report import build_report, parse_snakemake_log, wilson

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHIPPED = ROOT / "data" / "rl_object"


def _load(p: Path) -> dict[str, Any]:
    return json.loads(p.read_text())


def _referenced(index: Path) -> list[str]:
    return re.findall(r"(?:src|href)='([^']+)'", index.read_text())


def _read_tb(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars as TensorBoard itself reads them back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir))
    ea.Reload()
    # Sorted by step: two event files written within one second are read in name order.
    return {t: sorted((e.step, e.value) for e in ea.Scalars(t)) for t in ea.Tags()["scalars"]}


# --------------------------------------------------------------------------- Wilson


def test_wilson_matches_hand_numbers() -> None:
    # p = 0.5, n = 10: centre 0.5, half-width 1.96 sqrt(0.025 + 1.96^2/400) / (1 + 1.96^2/10)
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.236593, abs=1e-5) and hi == pytest.approx(0.763407, abs=1e-5)
    # 0 / 10: the interval starts at 0 (a normal approximation would give [0, 0])
    lo, hi = wilson(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(0.277539, abs=1e-5)
    lo, hi = wilson(66, 200)
    assert lo == pytest.approx(0.268573, abs=1e-5) and hi == pytest.approx(0.397834, abs=1e-5)
    assert all(math.isnan(v) for v in wilson(0, 0))


# --------------------------------------------------------------------------- shipped run


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def shipped_listing() -> dict[str, int]:
    return _listing(SHIPPED)


@pytest.fixture(scope="module")
def shipped_report(tmp_path_factory, shipped_listing) -> Path:
    out = tmp_path_factory.mktemp("report")
    res = CliRunner().invoke(app, ["report", str(SHIPPED), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_shipped_run_report_files(shipped_report: Path, shipped_listing: dict[str, int]) -> None:
    out = shipped_report
    index = out / "index.html"
    assert index.is_file()
    for png in ("learning_curves.png", "training_health.png", "task_heatmap.png"):
        with Image.open(out / png) as im:
            assert im.format == "PNG" and im.width > 400 and im.height > 200
    refs = _referenced(index)
    assert "learning_curves.png" in refs and "task_heatmap.png" in refs
    for ref in refs:  # every image, video and link of the page is beside it
        assert (out / ref).is_file(), ref
    assert "http://" not in index.read_text() and "https://" not in index.read_text()
    figs = _load(out / "report.json")["figures"]
    titles = {k: [a["title"] for a in f["axes"]] for k, f in figs.items()}
    assert titles["learning_curves"][:2] == ["success", "sample efficiency"]
    assert {"actor KL(pi_new || pi_old)", "actor clip fraction (per epoch)", "world model"} <= set(
        titles["training_health"]
    )
    assert figs["learning_curves"]["axes"][0]["ylabel"] == "success rate"
    assert figs["task_heatmap"]["axes"][0]["title"] == "per-task eval success"
    assert _listing(SHIPPED) == shipped_listing  # the report wrote nothing into the run


def test_shipped_run_numbers_equal_the_inputs(shipped_report: Path) -> None:
    data = _load(shipped_report / "report.json")
    html = (shipped_report / "index.html").read_text()
    rows = {r["iteration"]: r for r in data["iterations"]}
    assert sorted(rows) == [0, 1, 2, 3, 4, 5]
    evals = 0
    for it, row in rows.items():
        d = SHIPPED / f"iter_{it:03d}"
        if (d / "eval.json").is_file():
            ev = _load(d / "eval.json")
            evals += 1
            got = row["eval"]
            assert got["average"]["rate"] == ev["average"]
            assert got["suites"]["libero_object"]["rate"] == ev["suites"]["libero_object"]
            for name, t in ev["tasks"].items():
                assert got["tasks"][name]["rate"] == t["success_rate"]
            n = sum(t["episodes"] for t in ev["tasks"].values())
            k = round(sum(t["success_rate"] * t["episodes"] for t in ev["tasks"].values()))
            assert (got["average"]["k"], got["average"]["n"]) == (k, n)
            assert got["average"]["ci95"] == pytest.approx(list(wilson(k, n)))
            assert f"{ev['average']:.3f}" in html
        else:
            assert "eval" not in row
        if (d / "reward.done").is_file():
            done = _load(d / "reward.done")
            assert row["rollout"]["success"] == done["success_rate"]
            assert row["rollout"]["source"] == "reward.done"
            assert row["reward"]["groups_kept"] == done["groups_kept"]
            assert row["reward"]["rec_advantage_share"] == done["rec_advantage_share"]
        if (d / "actor" / "metrics.json").is_file():
            m = _load(d / "actor" / "metrics.json")
            assert row["actor"]["kl"] == m["kl"]
            assert row["actor"]["early_stop"] == m["early_stop"]
            assert [e["clip_fraction"] for e in row["actor"]["epochs"]] == [
                e["clip_fraction"] for e in m["epochs"]
            ]
        if (d / "world_model" / "metrics.json").is_file():
            wm = _load(d / "world_model" / "metrics.json")
            assert row["world_model"]["video_loss"] == wm["video_loss"]
            assert row["world_model"]["kl"] == wm["kl"]
    assert evals == 3
    m = data["task_matrix"]
    assert m["iterations"] == [0, 2, 5] and len(m["tasks"]) == 10
    ev5 = _load(SHIPPED / "iter_005" / "eval.json")
    for name, vals in zip(m["tasks"], m["values"], strict=True):
        assert vals[-1] == ev5["tasks"][name]["success_rate"]


# --------------------------------------------------------------------------- hand-made runs


def _eval(it: int, rates: dict[str, float], episodes: int = 10) -> dict[str, Any]:
    tasks = {
        n: {"suite": "libero_object", "success_rate": r, "episodes": episodes}
        for n, r in rates.items()
    }
    avg = float(np.mean(list(rates.values())))
    return {
        "iteration": it,
        "episodes_per_task": episodes,
        "tasks": tasks,
        "suites": {"libero_object": avg},
        "average": avg,
        "wall_time_s": 1.0,
    }


def test_three_evals_and_a_half_finished_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    a, b = (
        "pick_up_the_ketchup_and_place_it_in_the_basket",
        "pick_up_the_milk_and_place_it_in_the_basket",
    )
    for it, rates in ((0, {a: 0.2, b: 0.5}), (1, {a: 0.4, b: 0.5}), (3, {a: 0.7, b: 0.3})):
        (run / f"iter_{it:03d}").mkdir(parents=True)
        (run / f"iter_{it:03d}" / "eval.json").write_text(json.dumps(_eval(it, rates)))
    # Iteration 2 is half done: a reward.done, an actor dir without metrics, a store being
    # written; iteration 4 has a half-written eval.json and an empty rollouts dir.
    (run / "iter_002" / "actor").mkdir(parents=True)
    (run / "iter_002" / "rollouts" / ".shard_000.zarr.tmp").mkdir(parents=True)
    (run / "iter_002" / "reward.done").write_text(
        json.dumps({"success_rate": 0.25, "episodes": 8, "groups_kept": 1, "groups_total": 2})
    )
    (run / "iter_004" / "rollouts").mkdir(parents=True)
    (run / "iter_003" / "eval_videos").mkdir()
    (run / "iter_003" / "eval_videos" / "07_ketchup_init0.mp4").write_bytes(b"not really")
    (run / "iter_004" / "eval.json").write_text('{"iteration": 4, "tas')
    index = build_report(run)
    out = run / "report"
    assert index == out / "index.html"
    data = _load(out / "report.json")
    ev = [(r["iteration"], r["eval"]["average"]["rate"]) for r in data["iterations"] if "eval" in r]
    assert ev == [(0, pytest.approx(0.35)), (1, pytest.approx(0.45)), (3, pytest.approx(0.5))]
    row1 = next(r for r in data["iterations"] if r["iteration"] == 1)
    assert (row1["eval"]["average"]["k"], row1["eval"]["average"]["n"]) == (9, 20)
    assert row1["eval"]["average"]["ci95"] == pytest.approx(list(wilson(9, 20)))
    assert data["task_matrix"]["values"] == [[0.2, 0.4, 0.7], [0.5, 0.5, 0.3]]
    row2 = next(r for r in data["iterations"] if r["iteration"] == 2)
    assert row2["rollout"]["success"] == 0.25 and "actor" not in row2
    for ref in _referenced(index):
        assert (out / ref).is_file(), ref
    html = index.read_text()
    assert "1 improved, 1 regressed" in html
    assert "eval_videos/iter_003/07_ketchup_init0.mp4" in _referenced(index)
    # first (7/20) against last (10/20) eval: unpaired, since these carry no outcomes
    change = data["eval_change"]
    assert change["z"] == pytest.approx(two_proportion_z(7, 20, 10, 20))
    assert change["paired"] is None and "two-proportion z = 0.96" in html


def test_report_pairs_evals_with_outcomes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    name = "pick_up_the_milk_and_place_it_in_the_basket"
    for it, outcomes in ((0, [True, False, False, False]), (4, [True, True, True, False])):
        ev = _eval(it, {name: sum(outcomes) / 4}, episodes=4)
        ev["tasks"][name]["outcomes"] = outcomes
        ev |= {"protocol": {"name": "wamrl"}, "config": {"eval": {"seed": 1234}}}
        (run / f"iter_{it:03d}").mkdir(parents=True)
        (run / f"iter_{it:03d}" / "eval.json").write_text(json.dumps(ev))
    index = build_report(run)
    # two episodes only policy 4 won, none only the base: p = 2 * 0.5^2
    assert _load(run / "report" / "report.json")["eval_change"]["paired"] == {
        "b_only": 2, "a_only": 0, "z": pytest.approx(math.sqrt(2)), "p": 0.5
    }  # fmt: skip
    assert "McNemar z = 1.41, p = 0.5" in index.read_text()


def test_empty_run_dir_still_reports(tmp_path: Path) -> None:
    index = build_report(tmp_path, tmp_path / "out")
    assert "No iteration directory yet" in index.read_text()


def test_snakemake_log_timing(tmp_path: Path) -> None:
    log = tmp_path / "x.snakemake.log"
    log.write_text(
        "[Fri Dec  4 18:25:04 2026]\nlocalrule rollout:\n    output: iter_001/rollouts\n"
        "    jobid: 8\n    wildcards: it=001, w=000\n"
        "[Fri Dec  4 18:25:10 2026]\nrule reward:\n    jobid: 3\n    wildcards: it=001\n"
        "[Fri Dec  4 18:25:26 2026]\nFinished jobid: 8 (Rule: rollout)\n"
        "[Fri Dec  4 18:25:30 2026]\nFinished job 3.\n"
        "[Fri Dec  4 18:25:31 2026]\nrule eval:\n    jobid: 4\n    wildcards: it=001\n"
        "[Fri Dec  4 18:25:33 2026]\nError in rule eval:\n    jobid: 4\n"
    )
    jobs = {j.rule: j for j in parse_snakemake_log(log)}
    assert jobs["rollout"].seconds == 22 and jobs["rollout"].wildcards == {"it": "001", "w": "000"}
    assert jobs["reward"].seconds == 20 and jobs["reward"].iteration == 1
    assert jobs["eval"].failed and jobs["eval"].end is None


# --------------------------------------------------------------------------- TensorBoard


def test_tb_scalars_read_back(tmp_path: Path) -> None:
    ev = _load(SHIPPED / "iter_005" / "eval.json")
    actor = _load(SHIPPED / "iter_005" / "actor" / "metrics.json")
    assert tb.log_scalars(tmp_path, "eval", 5, tb.eval_scalars(ev)) == tmp_path / "tb" / "eval"
    actor["kl_by_task"] = {"12": 0.004, "14": 0.02}  # newer than the shipped run
    tb.log_scalars(tmp_path, "actor", 5, lambda: tb.actor_scalars(actor))
    tb.log_scalars(tmp_path, "actor", 6, {"actor/kl": 0.5, "actor/skipped": None})
    got = _read_tb(tmp_path / "tb" / "eval")
    assert got["eval/average"] == [(5, pytest.approx(ev["average"], rel=1e-6))]
    assert got["eval/libero_object"] == [(5, pytest.approx(ev["suites"]["libero_object"]))]
    got = _read_tb(tmp_path / "tb" / "actor")
    assert got["actor/kl"] == [(5, pytest.approx(actor["kl"])), (6, pytest.approx(0.5))]
    last = actor["epochs"][-1]
    assert got["actor/approx_kl"] == [(5, pytest.approx(last["approx_kl"]))]
    assert got["actor/clip_fraction"] == [(5, pytest.approx(last["clip_fraction"]))]
    assert got["actor/early_stop"] == [(5, 1.0)]
    assert got["actor/kl_k7"] == [(5, pytest.approx(actor["kl_by_k_star"]["7"]))]
    assert got["actor/kl_task14"] == [(5, pytest.approx(0.02))]
    assert "actor/skipped" not in got
    assert len(list((tmp_path / "tb" / "actor").glob("events.out.tfevents.*"))) == 2


def test_tb_failure_is_a_warning(tmp_path: Path, monkeypatch) -> None:
    import torch.utils.tensorboard

    def broken(*a: Any, **k: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", broken)
    with pytest.warns(UserWarning, match="disk full"):
        assert tb.log_scalars(tmp_path, "eval", 1, {"eval/average": 0.5}) is None

    def bad_metrics() -> dict[str, float]:
        raise KeyError("epochs")

    monkeypatch.undo()
    with pytest.warns(UserWarning, match="epochs"):
        assert tb.log_scalars(tmp_path, "actor", 1, bad_metrics) is None
    with pytest.warns(UserWarning, match="source tree"):
        assert tb.log_scalars(ROOT, "actor", 1, {"actor/kl": 0.1}) is None
    assert not (ROOT / "tb").exists()


# --------------------------------------------------------------------------- stores + stages
# run_after_reward (tests/conftest.py): the learner tests' synthetic run, after the reward stage.


def test_reward_stage_writes_tb_scalars(run_after_reward) -> None:
    run, _ = run_after_reward
    done = _load(run / "iter_001" / "reward.done")
    got = _read_tb(run / "tb" / "reward")
    assert got["rollout/success"] == [(1, pytest.approx(done["success_rate"]))]
    assert got["reward/groups_kept"] == [(1, done["groups_kept"])]
    assert got["reward/rec_advantage_share"] == [(1, pytest.approx(done["rec_advantage_share"]))]


def test_stage_tb_failure_does_not_fail_the_stage(run_after_reward, monkeypatch) -> None:
    import torch.utils.tensorboard

    import stages.reward

    run, cfg = run_after_reward
    before = _load(run / "iter_001" / "reward.done")

    def broken(*a: Any, **k: Any) -> None:
        raise PermissionError("read-only tb dir")

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", broken)
    # The stage's own computation is tested elsewhere (test_learner): replay its summary.
    summary = {k: v for k, v in before.items() if k not in ("iteration", "config", "shards")}
    monkeypatch.setattr(stages.reward, "run_reward", lambda *a, **k: dict(summary))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stages.reward.main(cfg, run, 1)  # the rerun of the stage completes
    assert any("read-only tb dir" in str(w.message) for w in caught)
    after = _load(run / "iter_001" / "reward.done")
    assert after["success_rate"] == before["success_rate"]


def test_report_with_stores_cuts_episode_videos(run_after_reward, tmp_path: Path) -> None:
    import imageio.v2 as imageio

    run, _ = run_after_reward
    index = build_report(run, tmp_path / "rep", videos_per_kind=1)
    data = _load(tmp_path / "rep" / "report.json")
    row = next(r for r in data["iterations"] if r["iteration"] == 1)
    # make_run: 2 shards x 4 episodes, success pattern [T, F, T, F]
    assert row["rollout"] == {
        **row["rollout"],
        "success": 0.5,
        "k": 4,
        "episodes": 8,
        "source": "stores",
    }
    clips = data["clips"]
    assert sorted(c["success"] for c in clips) == [False, True]
    ok = next(c for c in clips if c["success"])
    assert ok["source"] == "video/frames" and ok["frames"] == 37  # the recorded episode
    bad = next(c for c in clips if not c["success"])
    assert bad["source"] == "step/image"
    for c in clips:
        assert c["file"] in _referenced(index)
        frames = imageio.mimread(tmp_path / "rep" / c["file"])
        assert len(frames) == c["frames"] and frames[0].shape == (224 + 48, 448, 3)
        assert "return" in c["caption"] and "task 3" in c["caption"]
    for ref in _referenced(index):
        assert (tmp_path / "rep" / ref).is_file(), ref


def test_snakefile_report_rule_runs_after_every_eval(tmp_path: Path) -> None:
    from test_snakefile import job_counts, plan

    p = plan(tmp_path, "report_html", "--config", "pipeline={iterations: 2}", "eval={every: 1}")
    assert p.returncode == 0, p.stderr[-2000:]
    counts = job_counts(p.stdout + p.stderr)
    assert counts["report_html"] == 1 and counts["eval"] == 2


CHECK_IMAGES = (
    "<script>window.addEventListener('load', () => document.body.setAttribute('data-broken',"
    " [...document.images].filter(i => i.naturalWidth === 0).map(i => i.getAttribute('src'))"
    ".join(' ') || 'none'));</script>"
)


def _broken_images(page: Path) -> str:
    """Load `page` in headless Chromium; the src of every image that did not load."""
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", CHECK_IMAGES + "</body>"))
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=5000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    m = re.search(r'data-broken="([^"]*)"', dom)
    assert m, "the page's load handler did not run"
    return m.group(1)


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (Debian: apt-get install chromium)")
def test_report_loads_in_headless_chromium_with_no_missing_image(tmp_path: Path) -> None:
    """By hand where chromium is installed: pytest -m browser."""
    page = build_report(ROOT / "data" / "rl_object", tmp_path / "report", None, 2)
    assert _broken_images(page) == "none"
    (tmp_path / "report" / "learning_curves.png").unlink()  # the check can fail
    assert _broken_images(page) == "learning_curves.png"


def test_an_annealed_run_reports_each_iterations_own_kl_bound() -> None:
    """actor.anneal: the report (and status) take each update's bound from its metrics.json
    trust_region, not the config's constant target_kl (data/rl_object_v10: 8 bounds)."""
    from wamrl.report import collect

    run = Path(__file__).parents[1] / "data" / "rl_object_v10"
    rows = {r["iteration"]: r for r in collect(run)["iterations"] if r.get("actor")}
    assert sorted(rows) == list(range(1, 9))
    for it, row in rows.items():
        m = _load(run / f"iter_{it:03d}" / "actor" / "metrics.json")
        assert row["actor"]["target_kl"] == m["trust_region"]["target_kl"]
        assert row["actor"]["target_kl"] == pytest.approx(0.01 * (1 - (it - 1) / 8) ** 2)
