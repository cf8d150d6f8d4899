#!/usr/bin/env python3
"""A run's learning curve: one row per iteration, from what exists on disk (a run may still
be going). Rollout success comes from the shard stores (or reward.done where the stores
are gone), the rest from the stages' JSON.

    python scripts/rl_curve.py RUN_DIR                       print the table
    python scripts/rl_curve.py RUN_DIR --out DIR [--plot]    + DIR/curve.json (+ curve.png)
    python scripts/rl_curve.py --from DIR/curve.json --out DIR --plot   plot a saved curve

Eval rows carry a 95 % Wilson interval, so a change can be read against binomial noise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a binomial rate k / n."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def rollout_row(it_dir: Path) -> dict[str, Any]:
    import zarr

    succ, n = 0, 0
    for shard in sorted((it_dir / "rollouts").glob("shard_*.zarr")):
        try:
            s = np.asarray(zarr.open_group(str(shard), mode="r")["episode/success"][:])
        except Exception:  # a store still being written
            continue
        succ, n = succ + int(s.sum()), n + len(s)
    return {"rollout_success": succ / n if n else None, "rollout_episodes": n}


def eval_row(ev: dict[str, Any]) -> dict[str, Any]:
    n = sum(t["episodes"] for t in ev["tasks"].values())
    k = round(sum(t["success_rate"] * t["episodes"] for t in ev["tasks"].values()))
    lo, hi = wilson(k, n)
    return {
        "eval_success": k / n if n else None,
        "eval_episodes": n,
        "eval_ci95": [lo, hi],
        "eval_tasks": {name: t["success_rate"] for name, t in ev["tasks"].items()},
    }


def collect(run: Path) -> list[dict[str, Any]]:
    rows = []
    for it_dir in sorted(run.glob("iter_[0-9][0-9][0-9]")):
        it = int(it_dir.name[5:])
        row: dict[str, Any] = {"iteration": it}
        done = _json(it_dir / "reward.done")
        if (it_dir / "rollouts").is_dir():
            row.update(rollout_row(it_dir))
        elif done:  # a shipped copy of a run (data/rl_object) keeps no stores
            row.update(rollout_success=done["success_rate"], rollout_episodes=done["episodes"])
        if done:
            row.update(
                {k: done.get(k) for k in ("groups_kept", "groups_total", "rec_advantage_share")}
            )
        actor = _json(it_dir / "actor" / "metrics.json")
        if actor:
            ep = actor.get("epochs") or [{}]
            row.update(
                actor_kl=actor.get("kl"),
                actor_kl_by_k_star=actor.get("kl_by_k_star"),
                actor_early_stop=actor.get("early_stop"),
                actor_optimizer_steps=len(actor.get("kl_trace", []))
                - bool(actor.get("early_stop")),
                actor_clip_fraction=ep[0].get("clip_fraction"),
                actor_grad_norm=ep[0].get("grad_norm"),
                actor_steps=actor.get("steps"),
                actor_lr=actor.get("config", {}).get("actor", {}).get("lr"),
                actor_minibatch=actor.get("config", {}).get("actor", {}).get("minibatch"),
                logp_check_worst_share_of_tol=actor.get("logp_check", {}).get(
                    "logp_check_worst_share_of_tol"
                ),
            )
        wm = _json(it_dir / "world_model" / "metrics.json")
        if wm:
            row["world_model"] = {k: v for k, v in wm.items() if isinstance(v, (int, float))}
        ev = _json(it_dir / "eval.json")
        if ev:
            row.update(eval_row(ev))
        rows.append(row)
    return rows


def fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'it':>3} {'rollout':>13} {'kept':>6} {'KL':>7} {'stop':>8} {'clip':>5} {'eval':>22}")
    for r in rows:
        ro = (
            f"{fmt(r.get('rollout_success'))}/{r.get('rollout_episodes')}"
            if r.get("rollout_episodes")
            else "-"
        )
        kept = f"{r['groups_kept']}/{r['groups_total']}" if "groups_kept" in r else "-"
        stop = r.get("actor_early_stop")
        stop_s = (
            f"e{stop['epoch']}m{stop['minibatch']}"
            if stop
            else ("-" if "actor_kl" not in r else "none")
        )
        ev = (
            f"{fmt(r['eval_success'])} [{fmt(r['eval_ci95'][0], '.2f')},"
            f"{fmt(r['eval_ci95'][1], '.2f')}] n={r['eval_episodes']}"
            if "eval_success" in r
            else "-"
        )
        print(
            f"{r['iteration']:>3} {ro:>13} {kept:>6} {fmt(r.get('actor_kl'), '.4f'):>7} "
            f"{stop_s:>8} {fmt(r.get('actor_clip_fraction'), '.2f'):>5} {ev:>22}"
        )


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, kx) = plt.subplots(1, 2, figsize=(11, 4))
    ro = [r for r in rows if r.get("rollout_success") is not None]
    # Iteration n's rollout runs policy n - 1: plot it where that policy is.
    ax.plot(
        [r["iteration"] - 1 for r in ro],
        [r["rollout_success"] for r in ro],
        "o-",
        label=f"rollout (a = 0.5, {ro[0]['rollout_episodes']} episodes)" if ro else None,
    )
    ev = [r for r in rows if r.get("eval_success") is not None]
    if ev:
        x = [r["iteration"] for r in ev]
        y = [r["eval_success"] for r in ev]
        err = [
            [y_ - r["eval_ci95"][0] for y_, r in zip(y, ev, strict=True)],
            [r["eval_ci95"][1] - y_ for y_, r in zip(y, ev, strict=True)],
        ]
        ax.errorbar(
            x,
            y,
            yerr=err,
            fmt="s-",
            capsize=4,
            label=f"eval (a = 0, K = 20, n = {ev[-1]['eval_episodes']}, 95 % CI)",
        )
    ax.set(xlabel="policy after iteration", ylabel="success rate", ylim=(0, 1), title=title)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    kl = [r for r in rows if r.get("actor_kl") is not None]
    kx.plot([r["iteration"] for r in kl], [r["actor_kl"] for r in kl], "o-")
    for r in kl:
        if r.get("actor_lr") is not None:
            kx.annotate(
                f"lr {r['actor_lr']:.1e}\nmb {r['actor_minibatch']}",
                (r["iteration"], r["actor_kl"]),
                textcoords="offset points",
                xytext=(0, 8),
                ha="center",
                fontsize=7,
            )
    kx.margins(x=0.1, y=0.3)
    kx.xaxis.get_major_locator().set_params(integer=True)
    kx.set(
        xlabel="iteration",
        ylabel="KL(pi_new || pi_old), per SDE step",
        yscale="log",
        title="actor step (exact KL over all kept steps)",
    )
    kx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", nargs="?", type=Path)
    ap.add_argument("--from", dest="saved", type=Path, help="a curve.json written earlier")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--title", default="libero_object, tiny base")
    a = ap.parse_args()
    if (a.run is None) == (a.saved is None):
        ap.error("give RUN_DIR or --from curve.json")
    rows = json.loads(a.saved.read_text())["iterations"] if a.saved else collect(a.run)
    print_table(rows)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        if not a.saved:
            (a.out / "curve.json").write_text(json.dumps({"iterations": rows}, indent=1))
        if a.plot:
            plot(rows, a.out / "curve.png", a.title)


if __name__ == "__main__":
    main()
