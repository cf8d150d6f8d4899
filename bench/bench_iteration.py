"""One whole iteration, stage by stage, against the env-only physics of its episodes.

    python bench/bench_iteration.py --config tests/micro.yaml --set env.mujoco_gl=osmesa  # CPU
    python bench/bench_iteration.py --config configs/rl_gpu.yaml                          # GPU box

In a fresh run dir (--run-dir, default a temporary one, removed unless --keep) it writes the
resolved config to .wamrl/config.yaml as the Snakefile does, runs init (iteration 0's policy:
a prerequisite, timed but not counted) and then iteration 1's jobs as the Snakefile runs
them, each a separate `wamrl <stage>` process with its log in logs/iter_001/, in DAG order:
the rollout shards together, reward, actor and world model together (Snakemake starts both
once reward is done), merge, eval. `--sequential` runs one job at a time instead (cleaner
per-stage figures on a busy machine; the DAG wall is then the sum). Each job runs through
bench/timed_stage.py: the same typer app, with timers wrapped around library functions.

Then, in the same run, the env-only time of the same episodes: per shard a pool of
rollout.envs_per_worker env processes (the same process count) runs that shard's episodes
(task, init state, video or not, and the length in macro-steps each episode actually had,
read from the stores) with the chunks the rollout executed (replayed from step/chain; or
--actions hold: the hold-still action) and the same renders, with no policy: every query is
answered at once. The eval's episodes (same tasks, init states, eval.envs processes, the
eval's one render per chunk) run with the hold-still action to their full budget
(eval.max_macro_steps): an upper bound where the eval succeeded early.

Every env process (the stages' and the env-only ones) records its phases (WAMRL_TIMING,
wamrl/timing.py): imports, env build, reset + settle, stepping, rendering, waiting for the
parent (queries) and the tail idle (done, waiting for the last episode of its pool).

Columns (seconds): wall = launch to exit of the job; start = launch to the stage's main
(interpreter, imports: typer, torch, wamrl); exit = main's end to the process's end. The
env columns are means over the job's env processes: imp (robosuite/LIBERO import), build,
reset (+ settle steps), step (physics, renders excluded), render (camera renders and the
model-image crop), query (waiting for the parent's answer: queries, batching), tail (idle
after its last episode, until the pool closes). Parent columns: pool (spawning the env
pool, closing it), load (policy checkpoint), loop (the episode loop, store writes
excluded), store (the time main waits on episode store, checkpoint and JSON writes: the
rollout's episodes are written by a thread, so only a full queue and the final join
count), learn (learner compute: reward imagination, PPO, LoRA update), other (the rest of
main: config checks, hashing, TensorBoard, set-up).

"env physics" is the floor: per env pool, the busiest env process's reset + step time
(renders included: the model needs them); pools running together count once (the
largest), the rollout's and the eval's add up. The closing ratio divides the iteration's
wall (first rollout launch to eval's exit) by it. A second ratio divides by the env-only
wall (cold: spawns, imports and env builds included).
Figures go to --json (default bench_iteration.json in the current folder), with every env
process's own record (`env_records`: phases and time stamps) beside the means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# ----------------------------------------------------------------- the DAG of one iteration


def dag_levels(workers: int, sequential: bool = False) -> list[list[tuple[str, int | None]]]:
    """Iteration n's jobs as (stage, worker) in the order the Snakefile's DAG allows: the
    jobs of a level run together (the shards; actor and world model both need only reward)."""
    levels = [
        [("rollout", w) for w in range(workers)],
        [("reward", None)],
        [("actor", None), ("world_model", None)],
        [("merge", None)],
        [("eval", None)],
    ]
    return [[job] for level in levels for job in level] if sequential else levels


def job_name(stage: str, worker: int | None) -> str:
    """The Snakefile's log name: rollout_{w}, else the rule."""
    return f"{stage}_{worker:03d}" if worker is not None else stage


def command(stage: str, iteration: int, worker: int | None) -> list[str]:
    """The Snakefile's shell command, as arguments after `wamrl`."""
    cmd = [stage.replace("_", "-")]
    if stage != "init":
        cmd += ["--iter", f"{iteration:03d}"]
    if worker is not None:
        cmd += ["--worker", f"{worker:03d}"]
    return [*cmd, "--run-dir", "."]


# ----------------------------------------------------------------- breakdown arithmetic

ENV_COLS = ("spawn", "imp", "build", "reset", "step", "render", "query", "tail")
PARENT_COLS = ("pool", "load", "read", "loop", "store", "learn", "other")
TOP_LEVEL = (
    "pool_start",
    "pool_close",
    "policy_load",
    "episodes",
    "store_open",
    "store_close",
    "store_final",
    "store_read",
    "compute",
    "tensorboard",
)  # fmt: skip  (phases of a stage's main that do not overlap)


def _s(phases: dict[str, Any], name: str) -> float:
    return float(phases.get(name, {}).get("s", 0.0))


def _n(phases: dict[str, Any], name: str) -> int:
    return int(phases.get(name, {}).get("n", 0))


def env_breakdown(rec: dict[str, Any], spawned_at: float | None = None) -> dict[str, float]:
    """One env process's record -> exclusive seconds per column. A reset renders once (its
    last settle step) and steps render on their own: the mean render is taken out of each.
    The first env build imports robosuite and LIBERO: that counts as imp, not build.
    spawned_at: when its pool started the process (spawn = from then to its first line)."""
    p, m = rec["phases"], rec.get("marks", {})
    start = m.get("worker_start")
    render_n, reset_n = _n(p, "render"), _n(p, "reset")
    per_render = _s(p, "render") / render_n if render_n else 0.0
    in_reset = per_render * min(reset_n, render_n)
    return {
        "spawn": start - spawned_at if start is not None and spawned_at is not None else 0.0,
        "imp": _s(p, "import") + (m["imported"] - start if "imported" in m and start else 0.0),
        "build": _s(p, "env_build") - _s(p, "import"),
        "reset": _s(p, "reset") - in_reset,
        "step": _s(p, "step") - (_s(p, "render") - in_reset),
        "render": _s(p, "render") + _s(p, "image"),
        "query": _s(p, "wait"),
        "tail": _s(p, "tail_idle"),
        "physics": _s(p, "reset") + _s(p, "step"),  # simulation incl. the renders used
        "physics_no_render": _s(p, "reset") + _s(p, "step") - _s(p, "render"),
        "env_steps": float(_n(p, "step")),
        "resets": float(reset_n),
        # the first reset alone (renders in): a cold scene or shader cache shows up here
        "reset_first": float(p.get("reset", {}).get("first", 0.0)),
    }


def mean_env(records: list[dict[str, Any]], spawned_at: float | None = None) -> dict[str, float]:
    """Mean of env_breakdown over a pool's processes, with the busiest one's physics."""
    if not records:
        return {}
    rows = [env_breakdown(r, spawned_at) for r in records]
    out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    out["physics_max"] = max(r["physics"] for r in rows)
    out["physics_no_render_max"] = max(r["physics_no_render"] for r in rows)
    out["env_steps"] = sum(r["env_steps"] for r in rows)
    out["resets"] = sum(r["resets"] for r in rows)
    out["processes"] = float(len(rows))
    return out


def stage_breakdown(rec: dict[str, Any], exit_time: float) -> dict[str, float]:
    """A timed_stage record + the process's exit time -> wall, start, main, exit and the
    parent columns (exclusive seconds)."""
    p, m = rec["phases"], rec["marks"]
    main = m["main_end"] - m["main_start"] if {"main_start", "main_end"} <= set(m) else 0.0
    inner = _s(p, "store_write_inner")
    loop = _s(p, "episodes") - inner if "episodes" in p else 0.0
    learn = _s(p, "compute") - inner if "compute" in p else 0.0
    if rec.get("stage") == "merge":
        learn = main - _s(p, "policy_load") - _s(p, "store_final")  # merging is its compute
    top = sum(_s(p, k) for k in TOP_LEVEL)
    out = {
        "wall": exit_time - m["launch"],
        "start": m.get("main_start", exit_time) - m["launch"],
        "interp": m["interpreter"] - m["launch"],
        "main": main,
        "exit": exit_time - m["main_end"] if "main_end" in m else 0.0,
        "pool": _s(p, "pool_start") + _s(p, "pool_close"),
        "load": _s(p, "policy_load"),
        "read": _s(p, "store_read"),
        "loop": loop,
        "store": _s(p, "store_open") + _s(p, "store_close") + _s(p, "store_final") + inner,
        "learn": learn,
        "other": main - top if rec.get("stage") != "merge" else 0.0,
    }
    return out


def physics_floor(pools: list[list[dict[str, float]]], key: str = "physics_max") -> float:
    """Env-physics seconds of pools run in sequence, each a list of pools run together:
    pools together count once (the busiest process of any), sequences add up. key
    physics_no_render_max: the same without the camera renders."""
    return sum(max((p.get(key, 0.0) for p in together), default=0.0) for together in pools)


def ratio(wall: float, floor: float) -> float:
    return wall / floor if floor > 0 else float("nan")


# ----------------------------------------------------------------- running the jobs


@dataclass
class Job:
    stage: str
    worker: int | None
    launch: float = 0.0
    exit: float = 0.0
    code: int | None = None
    timing_dir: Path = field(default_factory=Path)


def run_level(jobs: list[Job], run: Path, iteration: int, env: dict[str, str]) -> None:
    """Start every job of a level, wait for all; a failure ends the benchmark with its log."""
    procs = []
    for job in jobs:
        name = job_name(job.stage, job.worker)
        log = run / "logs" / (f"iter_{iteration:03d}" if job.stage != "init" else "iter_000")
        log.mkdir(parents=True, exist_ok=True)
        job.timing_dir = run / "timing" / name
        job.launch = time.time()
        e = {**env, "WAMRL_TIMING": str(job.timing_dir), "WAMRL_TIMING_LAUNCH": repr(job.launch)}
        cmd = [sys.executable, str(REPO / "bench" / "timed_stage.py"), *command(
            job.stage, iteration, job.worker)]  # fmt: skip
        out = open(log / f"{name}.log", "w")  # noqa: SIM115 (closed when the job ends)
        procs.append(
            (job, subprocess.Popen(cmd, cwd=run, env=e, stdout=out, stderr=subprocess.STDOUT), out)
        )

    def wait(job: Job, proc: subprocess.Popen, out: Any) -> None:
        job.code = proc.wait()
        job.exit = time.time()
        out.close()

    threads = [threading.Thread(target=wait, args=item) for item in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job, _, out in procs:
        if job.code != 0:
            sys.exit(f"{job_name(job.stage, job.worker)} failed (exit {job.code}): see {out.name}")


# ----------------------------------------------------------------- env-only episodes


def drive(pool: Any, episodes: list[dict[str, Any]], record_frames: bool) -> int:
    """Run episodes on a pool with no policy: each query is answered at once with the
    episode's next recorded chunk (or the hold-still action). Returns env steps."""
    import numpy as np

    from wamrl.envs.conventions import DUMMY_ACTION
    from wamrl.envs.pool import Crashed, Query, StepResult

    hold = np.repeat(DUMMY_ACTION[None], pool.replan, 0)
    todo = list(reversed(episodes))
    running: dict[int, tuple[dict[str, Any], int]] = {}  # slot -> (episode, chunks sent)
    steps = 0

    def start(slot: int) -> None:
        ep = todo.pop()
        running[slot] = (ep, 0)
        pool.start_episode(
            slot, ep["task"], ep["init_state"], ep["video"], ep["macro_steps"], record_frames
        )

    for slot in range(min(len(pool), len(todo))):
        start(slot)
    while running:
        for ev in pool.poll(timeout=None):
            if isinstance(ev, Query):
                ep, k = running[ev.slot]
                actions = ep["actions"]
                pool.send_chunk(
                    ev.slot, actions[k] if actions is not None and k < len(actions) else hold
                )
                running[ev.slot] = (ep, k + 1)
            elif isinstance(ev, StepResult | Crashed):
                steps += getattr(ev, "env_steps", 0)
                if isinstance(ev, Crashed) or ev.done:
                    del running[ev.slot]
                    if todo:
                        start(ev.slot)
    return steps


def rollout_episodes(run: Path, iteration: int, workers: int, replay: bool) -> list[list[dict]]:
    """Per shard, its episodes as the store holds them: task, init state, video, length in
    macro-steps, and (replay) the env actions of every executed chunk."""
    import numpy as np
    import zarr

    from wamrl import paths
    from wamrl.envs.conventions import Normalizer, env_actions
    from wamrl.envs.tasks import load_tasks

    tasks = load_tasks()
    normalizer = Normalizer.load(paths.policy_dir(run, iteration - 1) / "stats.json")
    shards = []
    for w in range(workers):
        root = zarr.open_group(str(paths.shard_path(run, iteration, w)), mode="r")
        table = {
            n: np.asarray(root[f"episode/{n}"][:])
            for n in ("task", "init_state", "length", "video_sft")
        }
        replan = int(root.attrs["config"]["env"]["replan_steps"])
        eps = []
        for i in range(len(table["task"])):
            length = int(table["length"][i])
            actions = None
            if replay and length:
                chain = np.asarray(root["step/chain"][i, :length, -1])  # [length, 32, 7]
                actions = [env_actions(c, normalizer, replan) for c in chain]
            eps.append({
                "task": tasks[int(table["task"][i])], "init_state": int(table["init_state"][i]),
                "video": bool(table["video_sft"][i]), "macro_steps": max(length, 1),
                "actions": actions,
            })  # fmt: skip
        shards.append(eps)
    return shards


def eval_episodes(cfg: dict[str, Any]) -> tuple[list[dict], bool]:
    """The eval stage's episodes (task, init state k % n, its macro-step cap) and its msaa."""
    from wamrl.envs.tasks import tasks_in_suites

    e = cfg["eval"]
    per_task, cap, msaa = e["episodes_per_task"], e["max_macro_steps"], bool(cfg["env"]["msaa"])
    try:
        from stages.eval import resolve_protocol

        proto = resolve_protocol(cfg)
        per_task, cap, msaa = proto.episodes_per_task, proto.max_macro_steps, proto.msaa
    except (ImportError, AttributeError, KeyError):
        pass
    tasks = tasks_in_suites(e["suites"])
    if e["tasks"] is not None:
        tasks = [t for t in tasks if t.index in set(e["tasks"])]
    eps = [
        {"task": t, "init_state": k % t.n_init_states, "video": False, "macro_steps": cap, "actions": None}
        for t in tasks for k in range(per_task)
    ]  # fmt: skip
    return eps, msaa


def env_only(cfg: dict[str, Any], run: Path, iteration: int, replay: bool) -> dict[str, Any]:
    """The env-only run: the rollout's shards (pools together), then the eval's episodes."""
    from wamrl import paths
    from wamrl.envs.pool import EnvPool

    stats = paths.policy_dir(run, iteration - 1) / "stats.json"
    out: dict[str, Any] = {}
    shards = rollout_episodes(run, iteration, cfg["rollout"]["workers"], replay)
    folder = run / "timing" / "env_only_rollout"
    os.environ["WAMRL_TIMING"] = str(folder)
    t0 = time.time()
    steps = [0] * len(shards)

    def shard(w: int) -> None:
        with EnvPool(
            cfg["rollout"]["envs_per_worker"], stats, dict(cfg["env"]), seed=cfg["seed"]
        ) as pool:
            steps[w] = drive(pool, shards[w], record_frames=True)

    threads = [threading.Thread(target=shard, args=(w,)) for w in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["rollout"] = {
        "wall": time.time() - t0, "spawned_at": t0, "env_steps": sum(steps), "episodes": sum(map(len, shards)),
        "actions": "replay" if replay else "hold", "timing_dir": str(folder),
    }  # fmt: skip
    eps, msaa = eval_episodes(cfg)
    folder = run / "timing" / "env_only_eval"
    os.environ["WAMRL_TIMING"] = str(folder)
    t0 = time.time()
    with EnvPool(
        cfg["eval"]["envs"], stats, {**cfg["env"], "msaa": msaa}, seed=cfg["eval"]["seed"]
    ) as pool:
        n = drive(pool, eps, record_frames=False)
    out["eval"] = {"wall": time.time() - t0, "spawned_at": t0, "env_steps": n, "episodes": len(eps),
                   "actions": "hold", "timing_dir": str(folder)}  # fmt: skip
    os.environ.pop("WAMRL_TIMING")
    return out


# ----------------------------------------------------------------- machine and report


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)  # fmt: skip
        gpu = ", ".join(q.stdout.split("\n")[:-1]) or None if q.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "gpu": gpu,
            "python": platform.python_version(), "load_avg_at_start": load}  # fmt: skip


def fmt(x: float | None) -> str:
    return "" if x is None or x != x else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def report(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = ("job", "wall", "start", "main", "exit", *ENV_COLS, *PARENT_COLS)
    table = Table(title=f"one iteration, {figures['config']} ({figures['machine']['cpu']}, "
                  f"{figures['machine']['cores']} cores, GPU {figures['machine']['gpu']})")  # fmt: skip
    for c in cols:
        table.add_column(c, justify="right")
    for name, j in figures["jobs"].items():
        e = j.get("env", {})
        table.add_row(name, *(fmt(j.get(c)) for c in ("wall", "start", "main", "exit")),
                      *(fmt(e.get(c)) for c in ENV_COLS), *(fmt(j.get(c)) for c in PARENT_COLS))  # fmt: skip
    for name, o in figures["env_only"].items():
        e = o.get("env", {})
        table.add_row(f"env only: {name}", fmt(o["wall"]), "", "", "",
                      *(fmt(e.get(c)) for c in ENV_COLS), *[""] * len(PARENT_COLS))  # fmt: skip
    console = Console()
    console.print(table)
    s = figures["summary"]
    console.print(
        f"iteration wall (first rollout launch to eval exit): {s['iteration_wall']:.1f} s; "
        f"init (not counted): {s['init_wall']:.1f} s\n"
        f"env physics (busiest env process's reset + step, rollout {s['physics_rollout']:.1f} s "
        f"+ eval {s['physics_eval']:.1f} s): {s['env_physics']:.1f} s; "
        f"env-only wall (cold): {s['env_only_wall']:.1f} s; without the renders: "
        f"{s['env_physics_no_render']:.1f} s\n"
        f"rollout stage vs its env physics: {s['rollout_ratio']:.1f}x; "
        f"biggest overhead: {s['biggest_overhead'][0]} ({s['biggest_overhead'][1]:.1f} s)\n"
        f"[bold]iteration wall / env-physics time = {s['ratio']:.1f}[/bold]  "
        f"(/ env-only wall = {s['ratio_env_only_wall']:.1f}, / physics without renders = "
        f"{s['ratio_no_render']:.1f})"
    )


def overheads(jobs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Seconds per kind of overhead, over the iteration's jobs (each job's own figures; jobs
    running together overlap, so these add up to more than the wall)."""
    out: dict[str, float] = {}
    for j in jobs.values():
        e = j.get("env", {})
        for k, v in {
            "process start + imports": j["start"] + j["exit"],
            "env spawn + imports": e.get("spawn", 0.0) + e.get("imp", 0.0),
            "env builds": e.get("build", 0.0),
            "env waiting for queries": e.get("query", 0.0),
            "env tail idle": e.get("tail", 0.0),
            "policy load": j["load"],
            "store writes": j["store"],
            "store reads": j["read"],
            "learner compute": j["learn"],
            "pool start/close": j["pool"],
            "other (in main)": j["other"],
        }.items():
            out[k] = out.get(k, 0.0) + v
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", "-c", type=Path, action="append", default=[], help="YAML over default.yaml"
    )
    p.add_argument("--set", "-s", action="append", default=[], help="override key.path=value")
    p.add_argument(
        "--run-dir", type=Path, default=None, help="a fresh folder (default: a temp one)"
    )
    p.add_argument("--keep", action="store_true", help="keep the run dir")
    p.add_argument("--sequential", action="store_true", help="one job at a time")
    p.add_argument("--actions", choices=["replay", "hold"], default="replay",
                   help="env-only rollout chunks: the recorded ones or hold-still")  # fmt: skip
    p.add_argument("--json", type=Path, default=Path("bench_iteration.json"))
    args = p.parse_args()

    from wamrl.atomic import write_text
    from wamrl.config import RUN_CONFIG, dump, load_config, parse_overrides
    from wamrl.timing import read_all

    cfg = load_config([c.resolve() for c in args.config], parse_overrides(args.set))
    if cfg["policy"]["base_checkpoint"] == "sft":
        sys.exit("policy.base_checkpoint: sft needs demos and SFT first; bench a run that starts "
                 "from a checkpoint (or null)")  # fmt: skip
    if args.run_dir is not None and args.run_dir.exists() and any(args.run_dir.iterdir()):
        sys.exit(f"{args.run_dir}: not empty (the benchmark needs a fresh run dir)")
    run = (args.run_dir or Path(tempfile.mkdtemp(prefix="bench_iteration_"))).resolve()
    run.mkdir(parents=True, exist_ok=True)
    write_text(run / RUN_CONFIG, dump(cfg))  # as the Snakefile's onstart does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    env.pop("WAMRL_TIMING", None)
    figures: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"), "machine": machine(),
        "config": " ".join(str(c) for c in args.config) + "".join(f" {s}" for s in args.set),
        "run_dir": str(run), "sequential": args.sequential, "jobs": {},
    }  # fmt: skip
    try:
        init = Job("init", None)
        run_level([init], run, 0, env)
        iteration, jobs = 1, []
        for level in dag_levels(cfg["rollout"]["workers"], args.sequential):
            level_jobs = [Job(stage, w) for stage, w in level]
            print(f"{datetime.now():%T} " + ", ".join(job_name(j.stage, j.worker) for j in level_jobs),
                  flush=True)  # fmt: skip
            run_level(level_jobs, run, iteration, env)
            jobs += level_jobs
        print(f"{datetime.now():%T} env only", flush=True)
        only = env_only(cfg, run, iteration, args.actions == "replay")
        for job in [init, *jobs]:
            recs = read_all(job.timing_dir, "stage")
            row = stage_breakdown(recs[0], job.exit)
            row["phases"] = recs[0]["phases"]
            row["not_timed"] = recs[0].get("not_timed", [])
            row["episodes_stats"] = recs[0].get("episodes_stats")
            env_recs = read_all(job.timing_dir, "env")
            if env_recs:
                row["env"] = mean_env(env_recs, recs[0]["marks"].get("pool_start@"))
                # every process's own phases and time stamps: the means hide a slow few, and
                # the timing folders stay behind on a machine that is given back
                row["env_records"] = env_recs
            figures["jobs"][job_name(job.stage, job.worker)] = row
        for o in only.values():
            o["env_records"] = read_all(o["timing_dir"], "env")
            o["env"] = mean_env(o["env_records"], o["spawned_at"])
        figures["env_only"] = only
        rollouts = [
            figures["jobs"][job_name("rollout", w)] for w in range(cfg["rollout"]["workers"])
        ]
        phys_rollout = physics_floor([[only["rollout"]["env"]]])
        phys_eval = physics_floor([[only["eval"]["env"]]])
        bare = physics_floor(
            [[only["rollout"]["env"]], [only["eval"]["env"]]], "physics_no_render_max"
        )
        wall = jobs[-1].exit - jobs[0].launch
        iter_jobs = {k: v for k, v in figures["jobs"].items() if k != "init"}
        over = overheads(iter_jobs)
        biggest = max(over.items(), key=lambda kv: kv[1])
        figures["summary"] = {
            "iteration_wall": wall, "init_wall": figures["jobs"]["init"]["wall"],
            "physics_rollout": phys_rollout, "physics_eval": phys_eval,
            "env_physics": phys_rollout + phys_eval,
            "env_only_wall": only["rollout"]["wall"] + only["eval"]["wall"],
            "rollout_ratio": ratio(max(r["wall"] for r in rollouts), phys_rollout),
            "overheads_s": over, "biggest_overhead": list(biggest),
            "ratio": ratio(wall, phys_rollout + phys_eval),
            "env_physics_no_render": bare, "ratio_no_render": ratio(wall, bare),
            "ratio_env_only_wall": ratio(wall, only["rollout"]["wall"] + only["eval"]["wall"]),
        }  # fmt: skip
        report(figures)
        args.json.write_text(json.dumps(figures, indent=1, default=str))
        print(f"figures: {args.json}")
    finally:
        if not args.keep and args.run_dir is None:
            shutil.rmtree(run, ignore_errors=True)
        elif args.keep or args.run_dir is not None:
            print(f"run dir: {run}")


if __name__ == "__main__":
    main()
