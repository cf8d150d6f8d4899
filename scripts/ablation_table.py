"""Issue #18's ablation table from `scripts/ablate_gpu.sh`'s OUT_DIR, as markdown.

    python scripts/ablation_table.py OUT_DIR N --base BASE/iter_000/eval.json

One row per variant folder (OUT_DIR/NAME holding iter_NNN/eval.json of policy N): its eval
with the Wilson 95 % interval, then paired against the base and against `recipe` (episodes
only the variant won / only the other won, McNemar's exact p; wamrl/compare.py), then per
iteration the rollout's success (reward.done) and the KL of the actor's update
(actor/metrics.json). A variant whose policy N has no eval is listed as not finished.
--png PATH also draws each finished variant's rate with its interval against the base's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wamrl.compare import compare  # noqa: E402
from wamrl.report import eval_summary  # noqa: E402


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _rate(ev: dict) -> str:
    """The eval's pooled rate over its tasks with the Wilson 95 % interval."""
    avg = eval_summary(ev)["average"]
    lo, hi = avg["ci95"]
    return f"{avg['k'] / avg['n']:.3f} [{lo:.2f}, {hi:.2f}]"


def _paired(a: dict, b: dict) -> str:
    """'won / lost (p)' of eval b against eval a, on the episodes they share."""
    p = compare(a, b)["paired"]
    return "unpaired" if p is None else f"{p['b_only']} / {p['a_only']} (p = {p['p']:.2g})"


def variants(out: Path, n: int) -> list[tuple[Path, dict | None]]:
    """Each variant folder (a run dir, or a shipped copy with iteration n) with its policy-n
    eval (None: not finished), `recipe` first."""
    last = f"iter_{n:03d}"
    dirs = sorted(
        (d for d in out.iterdir() if (d / ".wamrl").is_dir() or (d / last).is_dir()),
        key=lambda d: (d.name != "recipe", d.name),
    )
    return [(d, _json(d / last / "eval.json")) for d in dirs]


def rows(out: Path, n: int, base: dict) -> list[str]:
    found = variants(out, n)
    recipe = {d.name: ev for d, ev in found}.get("recipe")
    head = (
        f"| variant | policy {n} [95 % CI] | vs the base: won / lost | vs `recipe`: won / lost "
        "| rollout success, iterations 1.. | KL of the update, iterations 1.. |"
    )
    lines = [head, "|" + " --- |" * 6]
    lines.append(f"| base | {_rate(base)} | | | | |")
    for d, ev in found:
        rollout, kl = [], []
        for i in range(1, n + 1):
            done = _json(d / f"iter_{i:03d}" / "reward.done")
            actor = _json(d / f"iter_{i:03d}" / "actor" / "metrics.json")
            if done:
                rollout.append(
                    f"{round(done['success_rate'] * done['episodes'])}/{done['episodes']}"
                )
            if actor and actor.get("kl") is not None:
                kl.append(f"{actor['kl']:.2g}")
        trail = f"{', '.join(rollout)} | {', '.join(kl)} |"
        if ev is None:
            lines.append(f"| `{d.name}` | not finished | | | {trail}")
            continue
        vs_recipe = "" if d.name == "recipe" or recipe is None else _paired(recipe, ev)
        lines.append(f"| `{d.name}` | {_rate(ev)} | {_paired(base, ev)} | {vs_recipe} | {trail}")
    return lines


def plot(out: Path, n: int, base: dict, png: Path) -> None:
    """Each finished variant's policy-N rate with its Wilson 95 % interval, the base's rate
    and interval behind them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, rates, errs = [], [], []
    for d, ev in variants(out, n):
        if ev is None:
            continue
        avg = eval_summary(ev)["average"]
        rate = avg["k"] / avg["n"]
        names.append(d.name)
        rates.append(rate)
        errs.append((rate - avg["ci95"][0], avg["ci95"][1] - rate))
    if not names:
        sys.exit(f"ablation_table: no variant in {out} has policy {n}'s eval to plot")
    b = eval_summary(base)["average"]
    fig, ax = plt.subplots(figsize=(6, 0.5 * len(names) + 1.2))
    ax.axvspan(*b["ci95"], color="0.9", label="base, 95 % CI")
    ax.axvline(b["k"] / b["n"], color="0.5", lw=1, label=f"base {b['k'] / b['n']:.3f}")
    y = range(len(names))[::-1]
    ax.errorbar(rates, y, xerr=list(zip(*errs, strict=True)), fmt="o", capsize=3)
    ax.set_yticks(list(y), names)
    ax.set_xlabel(f"eval success of policy {n} (Wilson 95 % CI)")
    # Intervals of each rate alone: on the same episodes, the paired counts of the table
    # resolve differences these overlaps hide.
    ax.set_title("unpaired intervals; paired tests: the table", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", type=Path, help="ablate_gpu.sh's OUT_DIR (one folder per variant)")
    ap.add_argument("n", type=int, help="the iteration whose policy was scored")
    ap.add_argument("--base", type=Path, required=True, help="the base policy's eval.json")
    ap.add_argument("--png", type=Path, help="also draw the finished variants' rates here")
    args = ap.parse_args()
    base = _json(args.base)
    if base is None:
        sys.exit(f"ablation_table: no such eval: {args.base}")
    if not args.out.is_dir():
        sys.exit(f"ablation_table: no such folder: {args.out}")
    print("\n".join(rows(args.out, args.n, base)))
    if args.png:
        plot(args.out, args.n, base, args.png)


if __name__ == "__main__":
    main()
