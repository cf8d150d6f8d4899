"""`wamrl report RUN_DIR`: one self-contained HTML page of a run (curves, health, videos).

Reads whatever exists (a run still going too): iter_NNN/eval.json, reward.done,
actor/metrics.json, world_model/metrics.json, the rollout stores (episode table, video/
frames or step/image for episode videos), iter_NNN/eval_videos/*.mp4 and the Snakemake logs
(.snakemake/log/*.log) for stage timing. Writes OUT/index.html with its PNGs, mp4s and
report.json (every plotted number) beside it; nothing is fetched from the network.

Conventions: iteration n's rollout runs policy n - 1, so rollout success is plotted at
x = n - 1 ("policy after iteration"), where that policy's eval is.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from wamrl.artifact import ArtifactError, read_json
from wamrl.compare import compare

Z95 = 1.959963984540054  # two-sided 95 % normal quantile
ITER_RE = re.compile(r"^iter_(\d{3})$")


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial rate k / n (95 % by default); (nan, nan) if n = 0.
    Unlike the normal approximation it stays inside [0, 1] and is honest at 0 % or 100 %,
    which small per-task evals hit often."""
    if n <= 0:
        return (math.nan, math.nan)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def _ci(k: int, n: int) -> list[float | None]:
    """wilson() as JSON: None instead of nan (no episodes)."""
    return [None if math.isnan(v) else v for v in wilson(k, n)]


def _json(path: Path) -> dict[str, Any] | None:
    """A JSON artifact, or None if absent or unreadable: a report of a live or damaged run
    shows what it can (the stages themselves refuse a damaged artifact by name)."""
    try:
        return read_json(path)
    except ArtifactError:
        return None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# --------------------------------------------------------------------------- timing


@dataclass
class Job:
    """One Snakemake job, from its log: rule, wildcards, start and finish times."""

    rule: str
    wildcards: dict[str, str]
    start: float  # unix seconds
    end: float | None = None
    failed: bool = False
    log: str = ""

    @property
    def iteration(self) -> int | None:
        it = self.wildcards.get("it")
        if it is not None and it.isdigit():
            return int(it)
        return 0 if self.rule == "init" else None

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start


_TS = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_RULE = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")
_FINISHED = re.compile(r"^Finished job(?:id:)? (\d+)")
_ERROR = re.compile(r"^Error in rule (\w+):$")


def _parse_ts(s: str) -> float:
    return datetime.strptime(" ".join(s.split()), "%a %b %d %H:%M:%S %Y").timestamp()


def parse_snakemake_log(path: Path) -> list[Job]:
    """Jobs of one Snakemake log (8.x "Finished job N." and 9.x "Finished jobid: N (Rule: x)").
    Job ids restart in every log, so they are only matched within it."""
    jobs: dict[int, Job] = {}
    now: float | None = None
    pending: Job | None = None  # a rule block whose jobid line has not come yet
    in_error = False
    for raw in path.read_text(errors="replace").splitlines():
        line = raw.strip()
        if m := _TS.match(line):
            now = _parse_ts(m.group(1))
            continue
        if (m := _RULE.match(line)) and now is not None:
            pending, in_error = Job(m.group(1), {}, now, log=path.name), False
            continue
        if m := _ERROR.match(line):
            in_error, pending = True, None
            continue
        if line.startswith("jobid:"):
            jid = int(line.split(":", 1)[1].split()[0])
            if in_error and jid in jobs:
                jobs[jid].failed = True
            elif pending is not None:
                jobs[jid] = pending
            continue
        if line.startswith("wildcards:") and pending is not None:
            for part in line.split(":", 1)[1].split(","):
                if "=" in part:
                    k, v = part.split("=", 1)
                    pending.wildcards[k.strip()] = v.strip()
            continue
        if (m := _FINISHED.match(line)) and now is not None:
            job = jobs.get(int(m.group(1)))
            if job is not None:
                job.end = now
    return list(jobs.values())


def stage_jobs(run: Path) -> list[Job]:
    """Every job of every Snakemake log of the run; a rerun of a job replaces the earlier."""
    latest: dict[tuple[str, tuple[tuple[str, str], ...]], Job] = {}
    for log in sorted((run / ".snakemake" / "log").glob("*.log")):
        try:
            jobs = parse_snakemake_log(log)
        except (OSError, ValueError):
            continue
        for j in jobs:
            key = (j.rule, tuple(sorted(j.wildcards.items())))
            if key not in latest or j.end is not None or latest[key].end is None:
                latest[key] = j
    return sorted(latest.values(), key=lambda j: j.start)


def artifact_times(run: Path) -> list[dict[str, Any]]:
    """Fallback timing without a Snakemake log: each artifact's mtime and the time since the
    artifact finished before it (an upper bound on its stage's wall-clock)."""
    names = ("reward.done", "actor", "world_model", "policy", "eval.json")
    found: list[tuple[float, str, int]] = []
    for it_dir in _iter_dirs(run):
        it = int(it_dir.name[5:])
        for name in names:
            p = it_dir / name
            if p.exists():
                found.append((p.stat().st_mtime, name, it))
        for s in sorted((it_dir / "rollouts").glob("shard_*.zarr")):
            found.append((s.stat().st_mtime, f"rollouts/{s.name}", it))
    found.sort()
    rows, prev = [], None
    for t, name, it in found:
        rows.append(
            {
                "iteration": it,
                "artifact": name,
                "finished": _fmt_time(t),
                "since_previous_s": None if prev is None else round(t - prev, 1),
            }
        )
        prev = t
    return rows


def _fmt_time(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


# --------------------------------------------------------------------------- collecting


def _iter_dirs(run: Path) -> list[Path]:
    return sorted(p for p in run.iterdir() if p.is_dir() and ITER_RE.match(p.name))


def _config(doc: dict[str, Any] | None) -> dict[str, Any]:
    """The resolved config an artifact recorded; a shipped copy may hold a pointer string."""
    cfg = (doc or {}).get("config")
    return cfg if isinstance(cfg, dict) else {}


def _replan_steps(run: Path, *docs: dict[str, Any] | None) -> int | None:
    for d in docs:
        v = _config(d).get("env", {}).get("replan_steps")
        if isinstance(v, int):
            return v
    try:
        import yaml

        for name in ("config.yaml", ".wamrl/config.yaml"):
            if (run / name).is_file():
                v = (yaml.safe_load((run / name).read_text()) or {}).get("env", {})
                if isinstance(v.get("replan_steps"), int):
                    return int(v["replan_steps"])
    except Exception:  # a config we cannot read only costs the env-step axis
        pass
    return None


def _open_shard(shard: Path) -> tuple[Any, dict[str, np.ndarray]]:
    """(group, episode table) of a complete store. Only the `complete` flag is checked, not
    every chunk file (open_store's validation): a report must stay fast on big stores, and
    what it reads fails loudly anyway if damaged."""
    import zarr

    from wamrl.store import read_episode_table

    root = zarr.open_group(str(shard), mode="r", zarr_format=3)
    if not root.attrs.get("complete"):
        raise RuntimeError(f"{shard}: not complete")
    return root, read_episode_table(root)


def _store_tables(it_dir: Path) -> list[tuple[Path, dict[str, np.ndarray]]]:
    """Episode tables of the iteration's complete stores (half-written ones are skipped)."""
    out = []
    for shard in sorted((it_dir / "rollouts").glob("shard_*.zarr")):
        try:
            out.append((shard, _open_shard(shard)[1]))
        except Exception:  # still being written, or damaged: the report shows what it can
            continue
    return out


def eval_summary(ev: dict[str, Any]) -> dict[str, Any]:
    """eval.json's rates with pooled counts and Wilson intervals (per suite and average)."""
    tasks = ev.get("tasks") or {}
    by_suite: dict[str, list[tuple[int, int]]] = defaultdict(list)
    out_tasks = {}
    for name, t in tasks.items():
        n = int(t.get("episodes", 0))
        k = round(float(t["success_rate"]) * n)
        by_suite[t.get("suite", "?")].append((k, n))
        out_tasks[name] = {
            "suite": t.get("suite"),
            "rate": float(t["success_rate"]),
            "k": k,
            "n": n,
            "ci95": _ci(k, n),
        }
    suites = {}
    for s, rate in (ev.get("suites") or {}).items():
        k = sum(k for k, _ in by_suite.get(s, []))
        n = sum(n for _, n in by_suite.get(s, []))
        suites[s] = {"rate": float(rate), "k": k, "n": n, "ci95": _ci(k, n)}
    k = sum(t["k"] for t in out_tasks.values())
    n = sum(t["n"] for t in out_tasks.values())
    avg = _num(ev.get("average"))
    return {
        "average": {
            "rate": avg if avg is not None else (k / n if n else None),
            "k": k,
            "n": n,
            "ci95": _ci(k, n),
        },
        "suites": suites,
        "tasks": out_tasks,
        "env_crashed": ev.get("env_crashed"),
        "wall_time_s": _num(ev.get("wall_time_s")),
    }


def collect(run: Path) -> dict[str, Any]:
    """Everything the report plots, one row per iteration directory (JSON-able)."""
    run = Path(run)
    rows: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    env_steps_total = 0.0
    for it_dir in _iter_dirs(run):
        it = int(it_dir.name[5:])
        row: dict[str, Any] = {"iteration": it}
        done = _json(it_dir / "reward.done")
        actor = _json(it_dir / "actor" / "metrics.json")
        replan = _replan_steps(run, done, actor)
        tables = _store_tables(it_dir) if (it_dir / "rollouts").is_dir() else []
        if tables:
            success = np.concatenate([t["success"] for _, t in tables]).astype(bool)
            lengths = np.concatenate([t["length"] for _, t in tables])
            row["rollout"] = {
                "success": float(success.mean()) if len(success) else None,
                "k": int(success.sum()),
                "episodes": len(success),
                "macro_steps": int(lengths.sum()),
                "source": "stores",
            }
        elif done and _num(done.get("success_rate")) is not None:
            # A shipped copy of a run (data/rl_object) keeps reward.done but no stores.
            n = int(done.get("episodes", 0))
            row["rollout"] = {
                "success": float(done["success_rate"]),
                "k": round(float(done["success_rate"]) * n),
                "episodes": n,
                "macro_steps": int(done.get("valid_steps", 0)),
                "source": "reward.done",
            }
        if "rollout" in row:
            r = row["rollout"]
            r["ci95"] = _ci(r["k"], r["episodes"])
            # Approximate: the last macro-step of an episode may stop before replan_steps.
            r["env_steps"] = r["macro_steps"] * replan if replan else None
            env_steps_total += r["env_steps"] or 0
        row["cum_env_steps"] = env_steps_total if env_steps_total else None
        if done:
            row["reward"] = {
                k: done.get(k)
                for k in (
                    "groups_kept",
                    "groups_total",
                    "rec_mean",
                    "rec_std",
                    "rec_advantage_share",
                    "rec_clipped_share",
                    "kept_steps",
                    "valid_steps",
                    "beta",
                )
            }
        if actor:
            acfg = _config(actor).get("actor") or {}
            row["actor"] = {
                "kl": _num(actor.get("kl")),
                "kl_by_k_star": actor.get("kl_by_k_star"),
                "kl_by_task": actor.get("kl_by_task"),
                "early_stop": actor.get("early_stop"),
                "kl_trace": actor.get("kl_trace"),
                "steps": actor.get("steps"),
                # the bound this update ran under: actor.anneal scales it per iteration
                "target_kl": _num(
                    (actor.get("trust_region") or {}).get("target_kl", acfg.get("target_kl"))
                ),
                "lr": _num(acfg.get("lr")),
                "epochs": [
                    {
                        k: _num(e.get(k))
                        for k in ("approx_kl", "kl", "clip_fraction", "ratio_mean", "grad_norm")
                    }
                    for e in actor.get("epochs") or []
                ],
            }
        wm = _json(it_dir / "world_model" / "metrics.json")
        if wm:
            row["world_model"] = {
                k: v for k, v in wm.items() if _num(v) is not None and k != "iteration"
            }
        ev = _json(it_dir / "eval.json")
        if ev and ev.get("tasks"):
            row["eval"] = eval_summary(ev)
            evals.append(ev)
        rows.append(row)
    jobs = stage_jobs(run) if run.is_dir() else []
    _attach_hours(rows, jobs)
    return {
        "run": str(run.resolve()),
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "iterations": rows,
        "jobs": [asdict(j) | {"iteration": j.iteration, "seconds": j.seconds} for j in jobs],
        "artifact_times": [] if jobs else artifact_times(run),
        # first eval against the last: the unpaired z and, where the episodes pair, McNemar's
        "eval_change": _eval_change(evals[0], evals[-1]) if len(evals) > 1 else None,
    }


def _eval_change(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any] | None:
    """wamrl.compare's totals of two evals; None where they share no task."""
    try:
        c = compare(first, last)
    except (ValueError, KeyError, TypeError, ZeroDivisionError):  # a hand-edited eval.json
        return None
    return {k: c[k] for k in ("a", "b", "n_a", "n_b", "z", "paired", "unpaired_because")}


def _attach_hours(rows: list[dict[str, Any]], jobs: list[Job]) -> None:
    """Wall-clock hours from the run's first job to each eval's finish (logs only: file
    mtimes of a copied run are the copy's, not the run's)."""
    if not jobs:
        return
    t0 = min(j.start for j in jobs)
    for r in rows:
        ends = [
            j.end
            for j in jobs
            if j.rule == "eval" and j.iteration == r["iteration"] and j.end is not None
        ]
        if ends:
            r["eval_hours"] = (max(ends) - t0) / 3600


# --------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, dpi: int) -> dict[str, Any]:
    """Save and close; returns the file name and each axis' title and labels (report.json
    keeps them, so a test or a reader can check what a PNG shows without looking at it)."""
    axes = [
        {"title": a.get_title(), "xlabel": a.get_xlabel(), "ylabel": a.get_ylabel()}
        for a in fig.axes
        if a.get_title() or a.get_xlabel() or a.get_ylabel()
    ]
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)
    return {"file": path.name, "axes": axes}


def _err(rate: float, ci: list[float | None]) -> tuple[float, float]:
    lo, hi = ci
    if lo is None or hi is None:
        return (0.0, 0.0)
    return (max(rate - lo, 0.0), max(hi - rate, 0.0))


def _errorbar(ax, xs: list[float], entries: list[dict[str, Any]], **kw: Any) -> None:
    ys = [e["rate"] for e in entries]
    errs = np.array([_err(e["rate"], e["ci95"]) for e in entries]).T.reshape(2, -1)
    ax.errorbar(xs, ys, yerr=errs, capsize=3, **kw)


def plot_learning_curves(rows: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    plt = _plt()
    ev = [r for r in rows if "eval" in r]
    ro = [r for r in rows if (r.get("rollout") or {}).get("success") is not None]
    has_steps = any(r.get("cum_env_steps") for r in ev)
    has_hours = any("eval_hours" in r for r in ev)
    ncols = 1 + has_steps + has_hours
    fig, axes = plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.2), squeeze=False)
    ax = axes[0][0]
    suites = sorted({s for r in ev for s in r["eval"]["suites"]})
    if len(suites) > 1:
        for s in suites:
            pts = [r for r in ev if s in r["eval"]["suites"]]
            _errorbar(
                ax,
                [r["iteration"] for r in pts],
                [r["eval"]["suites"][s] for r in pts],
                fmt="o--",
                alpha=0.6,
                label=f"eval {s}",
            )
    if ev:
        _errorbar(
            ax,
            [r["iteration"] for r in ev],
            [r["eval"]["average"] for r in ev],
            fmt="s-",
            lw=2,
            color="k",
            label=f"eval average (n = {ev[-1]['eval']['average']['n']}, 95 % Wilson)",
        )
    if ro:
        _errorbar(
            ax,
            [r["iteration"] - 1 for r in ro],
            [{"rate": r["rollout"]["success"], "ci95": r["rollout"]["ci95"]} for r in ro],
            fmt="^-",
            color="tab:orange",
            alpha=0.8,
            label="rollout (sampling noise on), at the policy it ran",
        )
    ax.set(
        xlabel="policy after iteration", ylabel="success rate", ylim=(-0.02, 1.02), title="success"
    )
    ax.xaxis.get_major_locator().set_params(integer=True)
    col = 1
    if has_steps:
        bx = axes[0][col]
        col += 1
        # Policy n was trained on the env steps of rollouts 1..n: cum_env_steps of row n.
        pts = [r for r in ev if r.get("cum_env_steps") or r["iteration"] == 0]
        _errorbar(
            bx,
            [r.get("cum_env_steps") or 0 for r in pts],
            [r["eval"]["average"] for r in pts],
            fmt="s-",
            color="k",
        )
        bx.set(
            xlabel="cumulative rollout env steps (approx.)",
            ylabel="eval average",
            ylim=(-0.02, 1.02),
            title="sample efficiency",
        )
    if has_hours:
        hx = axes[0][col]
        pts = [r for r in ev if "eval_hours" in r]
        _errorbar(hx, [r["eval_hours"] for r in pts], [r["eval"]["average"] for r in pts], fmt="s-")
        hx.set(
            xlabel="wall-clock hours since the run started",
            ylabel="eval average",
            ylim=(-0.02, 1.02),
        )
        hx.set_title("wall clock")
    for a in axes[0]:
        a.grid(alpha=0.3)
    if ev or ro:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = out / "learning_curves.png"
    return _save(fig, path, 110)


def plot_health(rows: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """Actor trust region, clipping, ratio, gradients; group filter; reward; world model."""
    plt = _plt()
    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    (kx, cx, rx, gx), (fx, wx, mx, sx) = axes
    act = [r for r in rows if "actor" in r]

    def per_epoch(key: str) -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for r in act:
            eps = r["actor"]["epochs"]
            for i, e in enumerate(eps):
                if e.get(key) is not None:
                    # Epochs of one iteration spread over [it, it + 0.8): still read as it.
                    xs.append(r["iteration"] + 0.8 * i / max(len(eps), 1))
                    ys.append(e[key])
        return xs, ys

    kl = [r for r in act if r["actor"]["kl"] is not None]
    kx.plot([r["iteration"] for r in kl], [r["actor"]["kl"] for r in kl], "o-", label="exact KL")
    kx.plot(*per_epoch("approx_kl"), ".", color="tab:gray", label="approx-KL per epoch")
    stops = [r for r in kl if r["actor"]["early_stop"]]
    if stops:
        kx.plot(
            [r["iteration"] for r in stops],
            [r["actor"]["kl"] for r in stops],
            "x",
            ms=12,
            mew=2,
            color="tab:red",
            label="KL early stop",
        )
        for r in stops:
            s = r["actor"]["early_stop"]
            kx.annotate(
                f"e{s.get('epoch')} mb{s.get('minibatch')}",
                (r["iteration"], r["actor"]["kl"]),
                textcoords="offset points",
                xytext=(4, 6),
                fontsize=7,
                color="tab:red",
            )
    bounds = [(r["iteration"], r["actor"]["target_kl"]) for r in act if r["actor"]["target_kl"]]
    if len({t for _, t in bounds}) == 1:
        kx.axhline(
            bounds[0][1], ls="--", color="tab:red", alpha=0.5, label=f"target_kl {bounds[0][1]:g}"
        )
    elif bounds:  # actor.anneal: a bound per iteration
        kx.plot(*zip(*bounds, strict=True), ls="--", color="tab:red", alpha=0.5, label="target_kl")
    if kl and all(r["actor"]["kl"] > 0 for r in kl):
        kx.set_yscale("log")
    kx.set(title="actor KL(pi_new || pi_old)", xlabel="iteration")
    for axis, key, title in (
        (cx, "clip_fraction", "actor clip fraction (per epoch)"),
        (rx, "ratio_mean", "actor ratio mean (per epoch)"),
        (gx, "grad_norm", "actor grad norm (per epoch)"),
    ):
        axis.plot(*per_epoch(key), "o", ms=4)
        axis.set(title=title, xlabel="iteration")
    rx.axhline(1.0, color="k", lw=0.8, alpha=0.5)

    rew = [r for r in rows if "reward" in r]
    kept = [r for r in rew if r["reward"].get("groups_total")]
    if kept:
        it = [r["iteration"] for r in kept]
        fx.bar(it, [r["reward"]["groups_total"] for r in kept], color="none", edgecolor="k")
        fx.bar(it, [r["reward"]["groups_kept"] for r in kept], color="tab:green", alpha=0.7)
    fx.set(title="groups kept (filled) / total (outline)", xlabel="iteration")
    rec = [r for r in rew if r["reward"].get("rec_mean") is not None]
    if rec:
        wx.errorbar(
            [r["iteration"] for r in rec],
            [r["reward"]["rec_mean"] for r in rec],
            yerr=[r["reward"].get("rec_std") or 0 for r in rec],
            fmt="o-",
            capsize=3,
            label="r_rec mean ± std",
        )
        share = [r for r in rec if r["reward"].get("rec_advantage_share") is not None]
        tw = wx.twinx()
        tw.plot(
            [r["iteration"] for r in share],
            [r["reward"]["rec_advantage_share"] for r in share],
            "s--",
            color="tab:purple",
        )
        tw.set_ylabel("share of |advantage| from r_rec", color="tab:purple")
        tw.set_ylim(0, 1)
    wx.set(title="reconstruction reward", xlabel="iteration", ylabel="r_rec (raw)")
    wm = [r for r in rows if "world_model" in r and "video_loss" in r["world_model"]]
    if wm:
        mx.plot([r["iteration"] for r in wm], [r["world_model"]["video_loss"] for r in wm], "o-")
        tw = mx.twinx()
        wkl = [r for r in wm if "kl" in r["world_model"]]
        tw.plot(
            [r["iteration"] for r in wkl],
            [r["world_model"]["kl"] for r in wkl],
            "s--",
            color="tab:red",
        )
        tw.set_ylabel("feature KL to the frozen model", color="tab:red")
    mx.set(title="world model", xlabel="iteration", ylabel="video loss")
    for r in act:
        kk = r["actor"].get("kl_by_k_star") or {}
        if kk:
            ks = sorted(kk, key=int)
            sx.plot([int(k) for k in ks], [kk[k] for k in ks], "o-", label=f"iter {r['iteration']}")
    sx.set(title="actor KL by denoising step k*", xlabel="k*")
    if any(r["actor"].get("kl_by_k_star") for r in act):
        sx.set_yscale("log")
        sx.legend(fontsize=7)
    if act:
        kx.legend(fontsize=7)
    for a in axes.flat:
        a.grid(alpha=0.3)
        if a is not sx:
            a.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    path = out / "training_health.png"
    return _save(fig, path, 100)


def _task_order() -> dict[str, tuple[int, str]]:
    """Task name -> (table index, suite), for sorting rows by suite then task."""
    try:
        from wamrl.envs.tasks import load_tasks

        return {t.name: (t.index, t.suite) for t in load_tasks()}
    except Exception:  # no task table: eval.json's order is good enough
        return {}


def task_matrix(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-task success (rows: tasks grouped by suite) × evaluated iteration."""
    ev = [r for r in rows if "eval" in r]
    order = _task_order()
    names: dict[str, str] = {}
    for r in ev:
        for name, t in r["eval"]["tasks"].items():
            names.setdefault(name, t.get("suite") or "?")
    tasks = sorted(names, key=lambda n: (order.get(n, (10**6, names[n]))[0], names[n], n))
    values = [
        [r["eval"]["tasks"][n]["rate"] if n in r["eval"]["tasks"] else None for r in ev]
        for n in tasks
    ]
    return {
        "tasks": tasks,
        "suites": [names[n] for n in tasks],
        "iterations": [r["iteration"] for r in ev],
        "values": values,
    }


def _change(vals: list[float | None]) -> float | None:
    seen = [v for v in vals if v is not None]
    return seen[-1] - seen[0] if len(seen) >= 2 else None


def plot_task_heatmap(m: dict[str, Any], out: Path) -> dict[str, Any]:
    plt = _plt()
    n_t, n_i = len(m["tasks"]), len(m["iterations"])
    fig, ax = plt.subplots(figsize=(4 + 0.8 * max(n_i, 1) + 4, 1.2 + 0.32 * max(n_t, 1)))
    data = np.array(
        [[np.nan if v is None else v for v in row] for row in m["values"]], dtype=float
    ).reshape(n_t, n_i)
    im = ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    labels = []
    for name, suite, row in zip(m["tasks"], m["suites"], m["values"], strict=True):
        d = _change(row)
        delta = "" if d is None else f"  ({d:+.2f})"
        short = name.replace("_", " ")[:60]
        labels.append(f"[{suite.replace('libero_', '')}] {short}{delta}")
    ax.set_yticks(range(n_t), labels, fontsize=7)
    ax.set_xticks(range(n_i), [str(i) for i in m["iterations"]])
    ax.set_xlabel("evaluated policy (after iteration); label: last - first")
    if n_t * n_i <= 800:
        for i in range(n_t):
            for j in range(n_i):
                if not math.isnan(data[i, j]):
                    ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center", fontsize=6)
    # A line between suites, so the grouping is visible.
    for i in range(1, n_t):
        if m["suites"][i] != m["suites"][i - 1]:
            ax.axhline(i - 0.5, color="k", lw=1.5)
    fig.colorbar(im, ax=ax, fraction=0.03, label="success rate")
    ax.set_title("per-task eval success")
    fig.tight_layout()
    path = out / "task_heatmap.png"
    return _save(fig, path, 110)


# --------------------------------------------------------------------------- videos


@dataclass
class Clip:
    iteration: int
    shard: str
    episode: int
    task: int
    task_name: str
    success: bool
    ret: float | None
    source: str  # "video/frames" (every env step) or "step/image" (one frame a macro-step)
    file: str = ""
    frames: int = 0

    @property
    def caption_lines(self) -> list[str]:
        r = "" if self.ret is None else f"   return {self.ret:+.3f}"
        ok = "SUCCESS" if self.success else "FAILURE"
        name = self.task_name.replace("_", " ")
        return [f"{ok}   iter {self.iteration}   task {self.task}{r}", name[:70], name[70:]]

    @property
    def caption(self) -> str:
        ok = "SUCCESS" if self.success else "FAILURE"
        r = "" if self.ret is None else f", return {self.ret:+.3f}"
        name = self.task_name.replace("_", " ")
        return f"{ok}: iter {self.iteration}, task {self.task} {name}{r}"


def _caption_frames(frames: np.ndarray, lines: list[str], ok: bool) -> list[np.ndarray]:
    """Frames with a caption band on top (green for success, red for failure); the band is
    48 px so a 224-high frame stays a multiple of 16 (what mp4 encoders want)."""
    from PIL import Image, ImageDraw

    width = frames.shape[2]
    band = np.zeros((48, width, 3), np.uint8)
    band[:] = (20, 110, 40) if ok else (140, 30, 30)
    img = Image.fromarray(band)
    draw = ImageDraw.Draw(img)
    for i, line in enumerate(lines[:3]):
        draw.text((6, 3 + 15 * i), line[: width // 6], fill=(255, 255, 255))
    band = np.asarray(img)
    return [np.concatenate([band, f], axis=0) for f in frames]


def _task_names() -> dict[int, str]:
    try:
        from wamrl.envs.tasks import load_tasks

        return {t.index: t.name for t in load_tasks()}
    except Exception:
        return {}


def episode_videos(
    run: Path, out: Path, iterations: list[int] | None, per_kind: int = 2
) -> list[Clip]:
    """mp4s of up to `per_kind` successful and `per_kind` failed rollout episodes for each
    chosen iteration (default: the first and last with stores). Episodes with recorded
    video/ frames are preferred (every env step); others show step/image, the model's input
    at each macro-step."""
    import imageio.v2 as imageio

    with_stores = [
        int(d.name[5:]) for d in _iter_dirs(run) if any((d / "rollouts").glob("shard_*.zarr"))
    ]
    chosen = (
        sorted(set(iterations) & set(with_stores))
        if iterations is not None
        else sorted({with_stores[0], with_stores[-1]})
        if with_stores
        else []
    )
    names = _task_names()
    clips: list[Clip] = []
    for it in chosen:
        picked = {True: 0, False: 0}
        for shard in sorted((run / f"iter_{it:03d}" / "rollouts").glob("shard_*.zarr")):
            try:
                root, table = _open_shard(shard)
            except Exception:  # still being written, or damaged
                continue
            has_reward = "reward" in {n for n, _ in root.members()}
            # Recorded-video episodes first: they show every env step.
            order = sorted(range(len(table["success"])), key=lambda e: -table["video_length"][e])
            for e in order:
                ok = bool(table["success"][e])
                if picked[ok] >= per_kind or table["length"][e] == 0:
                    continue
                nv, nl = int(table["video_length"][e]), int(table["length"][e])
                if nv > 0:
                    frames, src, fps = root["video/frames"][e, :nv], "video/frames", 20
                else:
                    frames, src, fps = root["step/image"][e, :nl], "step/image", 4
                ret = float(root["reward/return"][e, 0]) if has_reward else None
                task = int(table["task"][e])
                clip = Clip(it, shard.name, e, task, names.get(task, ""), ok, ret, src)
                clip.file = f"videos/iter_{it:03d}_{shard.stem}_ep{e:03d}.mp4"
                clip.frames = len(frames)
                (out / "videos").mkdir(parents=True, exist_ok=True)
                imageio.mimwrite(
                    out / clip.file,
                    _caption_frames(np.asarray(frames), clip.caption_lines, ok),
                    fps=fps,
                    macro_block_size=16,
                )
                clips.append(clip)
                picked[ok] += 1
            if all(v >= per_kind for v in picked.values()):
                break
    return clips


def copy_eval_videos(run: Path, out: Path) -> list[dict[str, Any]]:
    """The eval stage's own mp4s, copied beside the report so the page stays self-contained."""
    found = []
    for d in _iter_dirs(run):
        for mp4 in sorted((d / "eval_videos").glob("*.mp4")):
            rel = f"eval_videos/{d.name}/{mp4.name}"
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(mp4, out / rel)
            found.append({"iteration": int(d.name[5:]), "file": rel, "name": mp4.stem})
    return found


# --------------------------------------------------------------------------- html


def _f(v: Any, spec: str = ".3f") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    h = "".join(f"<th>{html.escape(str(x))}</th>" for x in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in r) + "</tr>" for r in rows
    )
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def summary_lines(data: dict[str, Any], matrix: dict[str, Any]) -> list[str]:
    """The verdict a reader wants first: did it learn, which tasks moved, was the KL sane."""
    rows = data["iterations"]
    ev = [r for r in rows if "eval" in r]
    lines = []
    if ev:
        a, b = ev[0]["eval"]["average"], ev[-1]["eval"]["average"]
        line = (
            f"Eval average: {_f(a['rate'])} [{_f(a['ci95'][0], '.2f')}, {_f(a['ci95'][1], '.2f')}]"
            f" after iteration {ev[0]['iteration']}"
        )
        if len(ev) > 1:
            ci = [*a["ci95"], *b["ci95"]]
            sep = None not in ci and (ci[1] < ci[2] or ci[3] < ci[0])
            line += (
                f" → {_f(b['rate'])} [{_f(b['ci95'][0], '.2f')}, {_f(b['ci95'][1], '.2f')}]"
                f" after iteration {ev[-1]['iteration']}: {b['rate'] - a['rate']:+.3f}"
                + (
                    " (95 % intervals do not overlap)"
                    if sep
                    else " (95 % intervals overlap: within binomial noise)"
                )
            )
            change = data.get("eval_change")
            if change:
                line += f"; two-proportion z = {change['z']:.2f}"
                if p := change["paired"]:
                    line += (
                        f"; paired by episode, {p['b_only']} won only after and {p['a_only']}"
                        f" only before: McNemar z = {p['z']:.2f}, p = {p['p']:.2g}"
                    )
        lines.append(line)
    deltas = [(n, _change(v)) for n, v in zip(matrix["tasks"], matrix["values"], strict=True)]
    deltas = [(n, d) for n, d in deltas if d is not None]
    if deltas:
        up = sum(d > 0 for _, d in deltas)
        down = sum(d < 0 for _, d in deltas)
        best = max(deltas, key=lambda x: x[1])
        worst = min(deltas, key=lambda x: x[1])
        lines.append(
            f"Tasks: {up} improved, {down} regressed, {len(deltas) - up - down} unchanged "
            f"(first → last eval); most improved {best[0]} ({best[1]:+.2f}), "
            f"most regressed {worst[0]} ({worst[1]:+.2f})."
        )
    act = [r for r in rows if (r.get("actor") or {}).get("kl") is not None]
    if act:
        top = max(act, key=lambda r: r["actor"]["kl"])
        stops = [r["iteration"] for r in act if r["actor"]["early_stop"]]
        tk = top["actor"]["target_kl"]
        lines.append(
            f"Actor KL: max {top['actor']['kl']:.4f} at iteration {top['iteration']}"
            + (f" (target_kl {tk:g})" if tk else "")
            + f"; KL early stop in iterations {stops or 'none'}."
        )
    ro = [r for r in rows if (r.get("rollout") or {}).get("success") is not None]
    if ro:
        lines.append(
            "Rollout success by iteration: "
            + ", ".join(f"{r['iteration']}: {r['rollout']['success']:.2f}" for r in ro)
            + f" (from {ro[-1]['rollout']['source']})."
        )
    if not rows:
        lines.append("No iteration directory yet.")
    return lines


def timing_html(data: dict[str, Any]) -> str:
    jobs = data["jobs"]
    if jobs:
        per: dict[tuple[str, int | None], list[dict[str, Any]]] = defaultdict(list)
        for j in jobs:
            per[(j["rule"], j["iteration"])].append(j)
        rows = []
        for (rule, it), js in sorted(per.items(), key=lambda x: (x[0][1] or -1, x[1][0]["start"])):
            ends = [j["end"] for j in js if j["end"] is not None]
            start = min(j["start"] for j in js)
            wall = max(ends) - start if len(ends) == len(js) else None
            busy = sum(j["seconds"] or 0 for j in js)
            state = "failed" if any(j["failed"] for j in js) else ("" if wall else "running")
            rows.append(
                [
                    it if it is not None else "",
                    rule,
                    len(js),
                    _fmt_time(start),
                    _f(wall, ".0f"),
                    _f(busy, ".0f"),
                    state,
                ]
            )
        tot: dict[str, float] = defaultdict(float)
        for j in jobs:
            tot[j["rule"]] += j["seconds"] or 0
        all_s = sum(tot.values()) or 1.0
        share = [
            [r, _f(s, ".0f"), f"{100 * s / all_s:.1f} %"]
            for r, s in sorted(tot.items(), key=lambda x: -x[1])
        ]
        return (
            "<p>From the Snakemake logs (.snakemake/log). Wall: first start to last finish of "
            "the rule's jobs in that iteration; job-seconds: summed over its jobs "
            "(parallel rollout workers add up).</p>"
            + _table(["iteration", "rule", "jobs", "started", "wall s", "job-seconds", ""], rows)
            + "<h3>Where the time goes</h3>"
            + _table(["rule", "job-seconds", "share"], share)
        )
    art = data["artifact_times"]
    if art:
        return (
            "<p>No Snakemake log: artifact modification times instead (a copied run's are "
            "the copy's). The gap to the previous artifact bounds that stage's time.</p>"
            + _table(
                ["iteration", "artifact", "finished", "since previous s"],
                [
                    [a["iteration"], a["artifact"], a["finished"], _f(a["since_previous_s"], ".1f")]
                    for a in art
                ],
            )
        )
    return "<p>No timing information.</p>"


def _iteration_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        a, rw = r.get("actor") or {}, r.get("reward") or {}
        ev = (r.get("eval") or {}).get("average")
        ro = r.get("rollout") or {}
        last = (a.get("epochs") or [{}])[-1]
        stop = a.get("early_stop")
        out.append(
            [
                r["iteration"],
                _f(ro.get("success")),
                ro.get("episodes", ""),
                f"{rw['groups_kept']}/{rw['groups_total']}" if rw.get("groups_total") else "–",
                _f(rw.get("rec_advantage_share")),
                _f(a.get("kl"), ".4f"),
                _f(last.get("clip_fraction")),
                _f(last.get("grad_norm"), ".2f"),
                f"e{stop.get('epoch')} mb{stop.get('minibatch')}" if stop else "–",
                _f((r.get("world_model") or {}).get("video_loss"), ".4f"),
                (
                    f"{_f(ev['rate'])} [{_f(ev['ci95'][0], '.2f')}, {_f(ev['ci95'][1], '.2f')}]"
                    if ev
                    else "–"
                ),
            ]
        )
    return _table(
        [
            "iter",
            "rollout success",
            "episodes",
            "groups kept",
            "r_rec adv. share",
            "actor KL",
            "clip frac (last epoch)",
            "grad norm (last epoch)",
            "KL stop",
            "WM video loss",
            "eval average [95 % CI]",
        ],
        out,
    )


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1400px;color:#222}
img{max-width:100%;border:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
th{background:#f3f3f3}
.summary{background:#f6f8fa;border-left:4px solid #0366d6;padding:.5em 1em}
.clips{display:flex;flex-wrap:wrap;gap:12px}
figure{margin:0}
figcaption{font-size:12px;max-width:448px}
.ok{color:#176f2c}.fail{color:#a31515}
"""


def render_html(
    data: dict[str, Any],
    matrix: dict[str, Any],
    images: dict[str, str],
    clips: list[Clip],
    eval_videos: list[dict[str, Any]],
) -> str:
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>wamrl report: {esc(Path(data['run']).name)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Run {esc(Path(data['run']).name)}</h1>",
        f"<p>{esc(data['run'])} · report generated {esc(data['generated'])} · "
        f"{len(data['iterations'])} iteration directories · "
        "<a href='report.json'>all numbers (report.json)</a></p>",
        "<div class='summary'><ul>",
        *(f"<li>{esc(s)}</li>" for s in summary_lines(data, matrix)),
        "</ul></div>",
        "<h2>Learning curves</h2>",
        "<p>Error bars: 95 % Wilson intervals of the pooled binomial counts. Iteration n's "
        "rollout ran policy n − 1 and is drawn there.</p>",
    ]
    for key, title in (
        ("learning_curves", ""),
        ("training_health", "Training health"),
        ("task_heatmap", "Per-task success"),
    ):
        if title:
            parts.append(f"<h2>{title}</h2>")
        if key in images:
            parts.append(f"<img src='{esc(images[key])}' alt='{key}'>")
        if key == "learning_curves":
            parts.append(_iteration_table(data["iterations"]))
    parts.append("<h2>Episodes</h2>")
    if clips:
        parts.append("<div class='clips'>")
        for c in clips:
            cls = "ok" if c.success else "fail"
            parts.append(
                f"<figure><video controls loop muted preload='metadata' width='448' "
                f"src='{esc(c.file)}'></video><figcaption class='{cls}'>{esc(c.caption)}<br>"
                f"{esc(c.shard)} episode {c.episode} · {c.frames} frames of {esc(c.source)}"
                "</figcaption></figure>"
            )
        parts.append("</div>")
    else:
        parts.append("<p>No rollout store with episodes (stores deleted or not written yet).</p>")
    if eval_videos:
        parts.append("<h3>Eval videos</h3><ul>")
        for v in eval_videos:
            parts.append(
                f"<li>iteration {v['iteration']}: "
                f"<a href='{esc(v['file'])}'>{esc(v['name'])}</a></li>"
            )
        parts.append("</ul>")
    parts += ["<h2>Stage timing</h2>", timing_html(data), "</body></html>"]
    return "\n".join(parts)


def build_report(
    run_dir: str | Path,
    out: str | Path | None = None,
    video_iterations: list[int] | None = None,
    videos_per_kind: int = 2,
) -> Path:
    """Write OUT/index.html (default RUN_DIR/report) and everything it shows; returns it."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"no run directory {run}")
    out_dir = Path(out) if out is not None else run / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("videos", "eval_videos"):  # ours alone: no clip of an earlier report lingers
        shutil.rmtree(out_dir / sub, ignore_errors=True)
    data = collect(run)
    matrix = task_matrix(data["iterations"])
    figures = {
        "learning_curves": plot_learning_curves(data["iterations"], out_dir),
        "training_health": plot_health(data["iterations"], out_dir),
    }
    if matrix["tasks"]:
        figures["task_heatmap"] = plot_task_heatmap(matrix, out_dir)
    images = {k: f["file"] for k, f in figures.items()}
    clips = episode_videos(run, out_dir, video_iterations, videos_per_kind)
    eval_videos = copy_eval_videos(run, out_dir)
    data["task_matrix"] = matrix
    data["clips"] = [asdict(c) | {"caption": c.caption} for c in clips]
    data["eval_videos"] = eval_videos
    data["figures"] = figures
    (out_dir / "report.json").write_text(json.dumps(data, indent=1, default=str))
    index = out_dir / "index.html"
    tmp = index.with_suffix(".html.tmp")
    tmp.write_text(render_html(data, matrix, images, clips, eval_videos))
    os.replace(tmp, index)  # a reader refreshing the page never sees half a file
    return index
