"""`wamrl <stage> ...` with timers around its parts, for bench/bench_iteration.py.

    WAMRL_TIMING=DIR python bench/timed_stage.py rollout --iter 1 --worker 0 --run-dir .

Runs the stage exactly as the `wamrl` command does (the same typer app, the same
arguments; env workers spawn the same way and import this file's imports, stages.cli, as
the console script's do), but first wraps a few library functions in timers, by name, so
that stages/*.py and the libraries others edit stay untouched: pool start and close, the
policy load, the episode loop (and the counts it returns), store writes (the time the
caller waits on them; the rollout's episode writes run in a thread), the learner update,
checkpoint writes, TensorBoard. A name that is gone (code moved) is skipped, not an error.
Writes DIR/stage_<pid>.json: phase seconds and time stamps (launch, interpreter up, imports
done, main start and end); the launching process passes its own launch time in
WAMRL_TIMING_LAUNCH.
"""

import time

T_INTERP = time.time()  # the interpreter is up and runs this file (before any import)

import contextlib  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

from stages.cli import app  # noqa: E402  (what the `wamrl` console script imports)

T_CLI = time.time()

# stage -> (module, attribute, phase) wrapped before the stage's main runs
PATCHES: dict[str, list[tuple[str, str, str]]] = {
    "rollout": [
        ("wamrl.envs.pool", "EnvPool.__init__", "pool_start"),
        ("wamrl.envs.pool", "EnvPool.close", "pool_close"),
        ("wamrl.policy", "load_policy", "policy_load"),
        ("wamrl.rollout", "run_episodes", "episodes"),
        ("wamrl.store", "ShardWriter.__init__", "store_open"),
        # write_episode queues the episode for the store's writer thread: its time is what
        # the loop waits on writes (a full queue); close joins the thread, then validates
        ("wamrl.store", "ShardWriter.write_episode", "store_write_inner"),
        ("wamrl.store", "ShardWriter.close", "store_close"),
        # the writes themselves, in the writer thread: overlapped with the loop, no column
        ("wamrl.store", "ShardWriter._write", "store_write_thread"),
        ("wamrl.tb", "log_scalars", "tensorboard"),
    ],
    "eval": [
        ("wamrl.envs.pool", "EnvPool.__init__", "pool_start"),
        ("wamrl.envs.pool", "EnvPool.close", "pool_close"),
        ("wamrl.policy", "load_policy", "policy_load"),
        ("wamrl.rollout", "run_episodes", "episodes"),
        ("stages.eval", "write_videos", "store_final"),
        ("stages.eval", "write_json", "store_final"),
    ],
    "reward": [
        ("wamrl.policy", "load_policy", "policy_load"),
        ("wamrl.store", "check_made_under", "store_read"),
        ("stages.reward", "run_reward", "compute"),
        ("wamrl.store", "write_reward_group", "store_write_inner"),  # inside compute
        ("stages.reward", "write_json", "store_final"),
        ("wamrl.tb", "log_scalars", "tensorboard"),
    ],
    "actor": [
        ("wamrl.policy", "load_policy", "policy_load"),
        ("wamrl.store", "check_made_under", "store_read"),
        ("stages.actor", "load_actor_data", "store_read"),
        ("stages.actor", "actor_update", "compute"),
        ("stages.actor", "atomic_dir", "store_final"),
        ("wamrl.tb", "log_scalars", "tensorboard"),
    ],
    "world_model": [
        ("wamrl.policy", "load_policy", "policy_load"),
        ("wamrl.store", "check_made_under", "store_read"),
        ("stages.world_model", "list_windows", "store_read"),
        ("stages.world_model", "world_model_update", "compute"),
        ("stages.world_model", "atomic_dir", "store_final"),
        ("wamrl.tb", "log_scalars", "tensorboard"),
    ],
    "merge": [
        ("wamrl.policy", "load_policy", "policy_load"),
        ("stages.merge", "atomic_dir", "store_final"),
    ],
    "init": [("stages.init", "atomic_dir", "store_final")],
}


CONTEXT_MANAGERS = {"atomic_dir"}


def _wrap(fn: Any, name: str, extra: dict[str, Any]) -> Any:
    from wamrl import timing

    rec = timing.phases()

    def inner(*args: Any, **kwargs: Any) -> Any:
        rec.marks.setdefault(f"{name}@", time.time())  # the phase's first start
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            rec.add(name, time.perf_counter() - t0)
            raise
        if fn.__name__ in CONTEXT_MANAGERS:  # the phase lasts until its block ends
            return _TimedCM(out, name, t0)
        rec.add(name, time.perf_counter() - t0)
        if name == "episodes" and isinstance(out, dict):  # run_episodes' counts
            extra.setdefault("episodes_stats", []).append(
                {k: v for k, v in out.items() if isinstance(v, int | float)}
            )
        return out

    return inner


class _TimedCM:
    """A context manager from a wrapped factory: the phase runs from the call to the exit."""

    def __init__(self, cm: Any, name: str, t0: float):
        self.cm, self.name, self.t0 = cm, name, t0

    def __enter__(self) -> Any:
        return self.cm.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.cm.__exit__(*exc)
        finally:
            from wamrl import timing

            timing.phases().add(self.name, time.perf_counter() - self.t0)


def patch(stage: str, extra: dict[str, Any]) -> list[str]:
    """Wrap the stage's functions in timers; returns the names that were not found."""
    missing = []
    for module, attr, name in PATCHES.get(stage, []):
        try:
            owner = importlib.import_module(module)
            *path, last = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, last, _wrap(getattr(owner, last), name, extra))
        except (ImportError, AttributeError):
            missing.append(f"{module}.{attr}")
    return missing


def main() -> None:
    from wamrl import timing

    stage = sys.argv[1].replace("-", "_")
    rec, extra = timing.phases(), {"stage": stage, "argv": sys.argv[1:]}
    with contextlib.suppress(ValueError):
        rec.marks["launch"] = float(os.environ.get("WAMRL_TIMING_LAUNCH", ""))
    rec.marks["interpreter"], rec.marks["cli_imported"] = T_INTERP, T_CLI
    module = importlib.import_module(f"stages.{stage}")  # what run_stage imports
    rec.mark("stage_imported")
    extra["not_timed"] = patch(stage, extra)
    stage_main = module.main

    def timed_main(*args: Any, **kwargs: Any) -> Any:
        rec.mark("main_start")
        try:
            return stage_main(*args, **kwargs)
        finally:
            rec.mark("main_end")

    module.main = timed_main
    code = 0
    try:
        app(sys.argv[1:], standalone_mode=False)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        code = 1
        raise
    finally:
        extra["exit_code"] = code
        timing.write("stage", extra)
    sys.exit(code)


if __name__ == "__main__":
    main()
