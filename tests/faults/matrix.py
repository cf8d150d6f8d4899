"""The slow fault matrix (#22): every stage killed with SIGKILL early, midway and at its
commit point, full and read-only disks mid-write, and damaged inputs, each on a copy of a
clean run of tests/micro.yaml (one iteration, 2 shards), then checked.

    python -m tests.faults.matrix                  # all trials; table on stdout
    python -m tests.faults.matrix -k reward        # trials whose name contains "reward"
    python -m tests.faults.matrix --out DIR        # also DIR/matrix.md and DIR/matrix.json

A trial removes RULE's outputs and everything after them from the copy (as if the run had
got that far), runs the run's command (`snakemake ... iter_001/eval.json`) with WAMRL_FAULT
set (wamrl.faults: the stage breaks itself at the named point), then the same command again
without it, as a user resumes, and checks: the resume
completes; no leftover (.NAME.tmp-*, .NAME.old-*) and no process of the trial survives;
`wamrl inspect` passes on every store; every array, tensor file and result equals the clean
run's (rollouts with one env per worker are deterministic); a disk fault also leaves nothing
that looks complete before the resume. A bad-input trial damages the copy, runs the command
and checks: it fails, the error names the damaged file, and no artifact was written.

To add a case, append a Trial to TRIALS (a `damage` function for bad inputs). Cases another
change must first make pass carry `pending`: listed, run only with --pending.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults.digest import differences, digest
from wamrl import atomic, paths
from wamrl.store_check import validate_store

REPO = Path(__file__).resolve().parents[2]
TARGET = "iter_001/eval.json"
WORKERS = 2  # tests/micro.yaml
COMMAND = [
    sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2",
    "--configfile", str(REPO / "tests" / "micro.yaml"),
    "--config", "env={mujoco_gl: egl}", "pipeline={iterations: 1}",
]  # fmt: skip
RULES = ("rollout", "reward", "actor", "world_model", "merge", "eval")
# A rule's outputs and those of every rule after it, relative to iter_001/.
_AFTER_MERGE = ("policy", "eval.json")
DOWNSTREAM = {
    "rollout": ("rollouts", "reward.done", "actor", "world_model", *_AFTER_MERGE),
    "reward": ("reward.done", "actor", *_AFTER_MERGE),
    "actor": ("actor", *_AFTER_MERGE),
    "world_model": ("world_model", *_AFTER_MERGE),
    "merge": _AFTER_MERGE,
    "eval": ("eval.json",),
}


@dataclass
class Trial:
    name: str
    rule: str  # the Snakemake rule made to run again (with everything after it)
    fault: str | None = None  # WAMRL_FAULT for that run
    damage: Callable[[Path], Path] | None = None  # breaks an input; returns the file
    kill_after_s: float | None = None  # kill -9 the stage from outside this long after it starts
    # ... or, if set, this long after its first child process (an env worker) exists: a fast
    # machine finishes the micro rollout within 15 s of its start, and the kill never struck
    kill_from_workers: bool = False
    pending: str | None = None  # why it cannot pass yet


@dataclass
class Outcome:
    trial: Trial
    first_rc: int = 0
    resume_rc: int | None = None
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


# ---- damage to inputs (each returns the path the error must name) ---------------------------


def _chunk(run: Path, w: int, array: str) -> Path:
    d = paths.shard_path(run, 1, w) / array / "c"
    return min(p for p in d.rglob("*") if p.is_file())


def truncate_chunk(run: Path) -> Path:
    f = _chunk(run, 0, "step/chain")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return paths.shard_path(run, 1, 0)


def delete_chunk(run: Path) -> Path:
    _chunk(run, 1, "step/image").unlink()
    return paths.shard_path(run, 1, 1)


def flip_chain_bytes(run: Path) -> Path:
    f = _chunk(run, 0, "step/chain")
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    b[mid : mid + 16] = bytes(x ^ 0xFF for x in b[mid : mid + 16])
    f.write_bytes(bytes(b))
    return paths.shard_path(run, 1, 0)


def flip_model_bytes(run: Path) -> Path:
    f = paths.policy_dir(run, 1) / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[-4096:-4032] = bytes(x ^ 0xFF for x in b[-4096:-4032])
    f.write_bytes(bytes(b))
    return f


def remove(rel: str) -> Callable[[Path], Path]:
    def damage(run: Path) -> Path:
        (run / rel).unlink()
        return run / rel

    damage.__name__ = f"remove {rel}"
    return damage


def garbage_config(run: Path) -> Path:
    f = run / ".wamrl" / "config.yaml"
    f.write_text("rollout: [1, 2\n  ::: not yaml at all\n")
    return f


# ---- the trials ------------------------------------------------------------------------------

# early: the stage started, nothing done; middle: partway through its work; late: its output
# complete under a temporary name, not yet renamed into place.
POINTS = {
    "rollout": ("start", "episode", "filled"),
    "reward": ("start", "reward_group", "filled", "moved_aside"),
    "actor": ("start", "temp", "filled"),
    "world_model": ("start", "temp", "filled"),
    "merge": ("start", "temp", "filled"),
    "eval": ("start", "episode", "text"),
}
DISK = {  # a full or read-only disk in the middle of each stage's writing
    "rollout": "episode",
    "reward": "reward_group",
    "actor": "filled",
    "world_model": "filled",
    "merge": "temp",
    "eval": "text",
}

TRIALS: list[Trial] = [
    *(Trial(f"kill {r} at {p}", r, f"{r}:{p}") for r in RULES for p in POINTS[r]),
    *(Trial(f"ENOSPC in {r} at {DISK[r]}", r, f"{r}:{DISK[r]}:enospc") for r in RULES),
    # From outside, at a time rather than a point: env workers mid-episode, LIBERO loaded.
    Trial("kill -9 from outside: rollout 3 s after its env workers start", "rollout",
          kill_after_s=3, kill_from_workers=True),  # fmt: skip
    Trial("kill -9 from outside: eval after 5 s", "eval", kill_after_s=5),
    Trial("EROFS in reward at filled", "reward", "reward:filled:erofs"),
    Trial("EROFS in rollout at episode", "rollout", "rollout:episode:erofs"),
    Trial("truncated step/chain chunk", "reward", damage=truncate_chunk),
    Trial("deleted step/image chunk", "reward", damage=delete_chunk),
    Trial("missing context.safetensors", "rollout", damage=remove("iter_000/policy/context.safetensors")),
    Trial("missing stats.json", "rollout", damage=remove("iter_000/policy/stats.json")),
    Trial("garbage .wamrl/config.yaml", "rollout", damage=garbage_config),
    Trial("flipped bytes in a step/chain chunk", "reward", damage=flip_chain_bytes),
    Trial("flipped bytes in iter_001 model.safetensors", "eval", damage=flip_model_bytes),
]  # fmt: skip


# ---- running ---------------------------------------------------------------------------------


def snakemake(
    run: Path,
    env: dict[str, str],
    kill: tuple[str, float] | None = None,
    from_workers: bool = False,
) -> subprocess.CompletedProcess:
    """The run's command; kill = (stage, seconds): kill -9 that stage's process that long
    after it starts (from_workers: after its first child process exists)."""
    if kill is None:
        return subprocess.run(
            [*COMMAND, "--", TARGET], cwd=run, env=env, capture_output=True, text=True,
            timeout=1800,
        )  # fmt: skip
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen([*COMMAND, "--", TARGET], cwd=run, env=env, stdout=out, stderr=out)
        stage, after = kill
        pid = None
        while pid is None and p.poll() is None:
            pid = next(iter(stage_processes(env["WAMRL_TRIAL"], stage)), None)
            time.sleep(0.2)
        while from_workers and pid is not None and p.poll() is None and not children(pid):
            time.sleep(0.1)
        if pid is not None:
            time.sleep(after)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        rc = p.wait(1800)
        out.seek(0)
        text = out.read()
    return subprocess.CompletedProcess(p.args, rc, text, "")


def children(pid: int) -> list[int]:
    """pid's child processes (/proc/PID/task/*/children); [] once it is gone."""
    out: list[int] = []
    for f in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in f.read_text().split()]
    return out


def stage_processes(token: str, stage: str) -> list[int]:
    """The trial's `wamrl STAGE` processes (the stage itself, not its shell or workers)."""
    out = []
    for pid in trial_processes(token):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"/wamrl") for a in argv[:2]) and stage.encode() in argv:
            out.append(pid)
    return out


def trial_processes(token: str) -> list[int]:
    """Processes (any depth, orphans too) started for a trial: they carry its token."""
    out = []
    needle = f"WAMRL_TRIAL={token}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie holds no memory or cores; its parent has gone
            if needle in (d / "environ").read_bytes().split(b"\0"):
                out.append(int(d.name))
        except (OSError, IndexError):
            continue
    return out


def survivors(token: str, grace_s: float = 5.0) -> list[int]:
    deadline = time.time() + grace_s
    while (left := trial_processes(token)) and time.time() < deadline:
        time.sleep(0.2)
    return left


def artifacts(run: Path) -> dict[str, int]:
    """Every file under the iteration folders, with its modification time."""
    out = {}
    for d in run.glob("iter_*"):
        for p in d.rglob("*"):
            if p.is_file() and p.name != ".snakemake_timestamp":
                out[str(p.relative_to(run))] = p.stat().st_mtime_ns
    return out


def looks_complete(run: Path, rule: str) -> list[str]:
    """The rule's outputs that exist (after its failed run: none may)."""
    outs = paths.stage_outputs(rule, run, 1, 0, WORKERS)
    if rule == "rollout":
        outs = paths.shard_paths(run, 1, WORKERS)
    if rule == "reward":
        outs = [paths.reward_done(run, 1)]
    return [str(p.relative_to(run)) for p in outs if p.exists()]


def run_trial(t: Trial, base: Path, reference: dict[str, str], work: Path) -> Outcome:
    o = Outcome(t)
    start = time.time()
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(base, run, symlinks=True)
    token = f"{os.getpid()}-{abs(hash(t.name))}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MUJOCO_GL": "egl", "WAMRL_TRIAL": token}
    env.pop("WAMRL_FAULT", None)
    for rel in DOWNSTREAM[t.rule]:
        p = paths.iter_dir(run, 1) / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    damaged = t.damage(run) if t.damage else None
    before = artifacts(run)
    kill = (t.rule.replace("_", "-"), t.kill_after_s) if t.kill_after_s else None
    first = snakemake(
        run, {**env, "WAMRL_FAULT": t.fault} if t.fault else env, kill, t.kill_from_workers
    )
    o.first_rc = first.returncode
    o.checks["fault struck (run failed)"] = first.returncode != 0
    o.checks["no process outlived the run"] = not survivors(token)
    if damaged is not None:
        out = first.stdout + first.stderr
        o.checks["error names the file"] = str(damaged.relative_to(run)) in out
        new = sorted(k for k, v in artifacts(run).items() if before.get(k) != v)
        o.checks["no artifact written"] = not new
        if new:
            o.notes.append(f"written: {new[:3]}")
        o.notes.append(_last_error(out))
    else:
        if t.kill_after_s or (t.fault and not t.fault.endswith(("enospc", "erofs"))):
            # the job's shell reports its stage's death by SIGKILL as exit status 128 + 9
            o.checks["killed by SIGKILL"] = "exit status 137" in first.stdout + first.stderr
        if t.fault and t.fault.endswith(("enospc", "erofs")):
            o.checks["nothing looks complete"] = not looks_complete(run, t.rule)
            o.checks["no leftover after the failure"] = not atomic.stale_under(run)
        resume = snakemake(run, env)
        o.resume_rc = resume.returncode
        o.checks["resume completes"] = resume.returncode == 0
        if resume.returncode != 0:
            o.notes.append(_last_error(resume.stdout + resume.stderr))
        o.checks["no process outlived the resume"] = not survivors(token)
        left = atomic.stale_under(run)
        o.checks["no leftover"] = not left
        if left:
            o.notes.append(f"left: {[str(p.relative_to(run)) for p in left][:3]}")
        if resume.returncode == 0:
            bad = [s for s in paths.shard_paths(run, 1, WORKERS) if validate_store(s, deep=True)]
            o.checks["inspect passes"] = not bad
            diff = differences(reference, digest(run, 1, WORKERS))
            o.checks["equals the clean run"] = not diff
            if diff:
                o.notes.append(f"differs: {diff[:4]}")
    o.seconds = time.time() - start
    return o


def _last_error(out: str) -> str:
    for line in reversed(out.splitlines()):
        if any(w in line for w in ("Error", "error", "No such file", "not a usable")):
            return line.strip()[:160]
    return ""


def table(outcomes: list[Outcome]) -> str:
    lines = [
        "| # | trial | rule | fault | 1st rc | resume rc | checks | outcome | s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, o in enumerate(outcomes, 1):
        t = o.trial
        at = f"{t.kill_after_s} s" + (" after env workers start" if t.kill_from_workers else "")
        fault = t.fault or (t.damage.__name__ if t.damage else f"kill -9 at {at}")
        failed = [k for k, v in o.checks.items() if not v]
        verdict = "pass" if o.ok else f"FAIL: {', '.join(failed)}"
        if t.pending:
            verdict = f"pending ({t.pending}): " + ("passes" if o.ok else ", ".join(failed))
        checks = f"{sum(o.checks.values())}/{len(o.checks)}"
        resume = "" if o.resume_rc is None else str(o.resume_rc)
        lines.append(
            f"| {i} | {t.name} | {t.rule} | `{fault}` | {o.first_rc} | {resume} | {checks} "
            f"| {verdict} | {o.seconds:.0f} |"
        )
    return "\n".join(lines)


def build_base(base: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MUJOCO_GL": "egl"}
    env.pop("WAMRL_FAULT", None)
    base.mkdir(parents=True)
    p = snakemake(base, env)
    if p.returncode != 0:
        raise SystemExit(f"the clean run failed:\n{p.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only trials whose name contains this")
    ap.add_argument("--pending", action="store_true", help="also run the pending trials")
    ap.add_argument("--out", type=Path, help="write matrix.md and matrix.json here")
    ap.add_argument("--work", type=Path, help="working folder (default: a temporary one)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="wamrl-faults-"))
    base = work / "clean"
    t0 = time.time()
    if not (base / TARGET).exists():
        print(f"clean run in {base} ...", flush=True)
        build_base(base)
    reference = digest(base, 1, WORKERS)
    trials = [t for t in TRIALS if args.k in t.name and (args.pending or not t.pending)]
    outcomes = []
    for i, t in enumerate(trials, 1):
        o = run_trial(t, base, reference, work)
        outcomes.append(o)
        status = "pass" if o.ok else "FAIL " + str([k for k, v in o.checks.items() if not v])
        print(f"[{i}/{len(trials)}] {t.name}: {status} ({o.seconds:.0f} s)", flush=True)
    md = table(outcomes)
    n_ok = sum(o.ok for o in outcomes)
    summary = (
        f"{n_ok}/{len(outcomes)} trials passed; {len(reference)} arrays, tensor files and "
        f"results compared with the clean run; {time.time() - t0:.0f} s in all."
    )
    print(md, "", summary, sep="\n")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "matrix.md").write_text(md + "\n\n" + summary + "\n")
        rows = [
            {
                "trial": o.trial.name, "rule": o.trial.rule, "fault": o.trial.fault,
                "first_rc": o.first_rc, "resume_rc": o.resume_rc, "checks": o.checks,
                "notes": o.notes, "seconds": round(o.seconds, 1), "pending": o.trial.pending,
            }
            for o in outcomes
        ]  # fmt: skip
        (args.out / "matrix.json").write_text(json.dumps(rows, indent=2) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(o.ok or o.trial.pending for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
