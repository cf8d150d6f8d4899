"""`wamrl`: every pipeline stage as a command, with the arguments Snakemake passes.

    wamrl demos --worker 0              scripted-expert demonstrations -> demos/shard_000.zarr
    wamrl sft                           SFT on the demos -> sft/policy
    wamrl context                       fastwam backend: the tasks' umT5 contexts -> context/
    wamrl init                          iteration 0: base policy + task contexts
    wamrl rollout --iter 3 --worker 0   one rollout shard
    wamrl reward  --iter 3              imagined-future rewards, returns, advantages
    wamrl actor   --iter 3              PPO on the action expert
    wamrl world-model --iter 3          LoRA update of the video expert
    wamrl merge   --iter 3              -> iter_003/policy
    wamrl eval    --iter 3              -> iter_003/eval.json
    wamrl inspect iter_003/rollouts/shard_000.zarr
    wamrl verify RUN_DIR                every artifact's checksums, sha256s and headers
    wamrl report RUN_DIR [--out DIR]    curves, health, videos -> DIR/index.html
    wamrl status RUN_DIR                one screen: stages done, KL, evals, the next job
    wamrl compare A/eval.json B/eval.json   is B better than A, beyond noise? (paired)
    wamrl config                        print the resolved config (validated)

Config: the run's resolved config (.wamrl/config.yaml in the run dir, written by the
Snakefile) if present, else configs/default.yaml; then --configfile files, then --set
key.path=value overrides. Every stage records the resolved config it ran with.

This module alone imports the stages (stages.<name>.main): the wamrl library never does, so
that it can be used and tested without them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from wamrl.config import RUN_CONFIG, ConfigError, dump, load_config, parse_overrides

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False)

RunDir = Annotated[
    Path, typer.Option("--run-dir", "-d", help="run directory (Snakemake's working dir)")
]
Iter = Annotated[int, typer.Option("--iter", "-i", help="iteration number", min=0)]
ConfigFiles = Annotated[
    list[Path] | None, typer.Option("--configfile", "-c", help="YAML merged over the run config")
]
Sets = Annotated[list[str] | None, typer.Option("--set", "-s", help="override: key.path=value")]


def resolve(
    run_dir: Path, configfiles: list[Path] | None, sets: list[str] | None
) -> dict[str, Any]:
    files = [run_dir / RUN_CONFIG] if (run_dir / RUN_CONFIG).is_file() else []
    try:
        return load_config([*files, *(configfiles or [])], parse_overrides(sets or []))
    except ConfigError as e:
        typer.secho(f"config error: {e}", fg="red", err=True)
        raise typer.Exit(2) from e


def run_stage(stage: str, cfg: dict[str, Any], run_dir: Path, **kwargs: Any) -> None:
    from wamrl import faults, paths
    from wamrl.atomic import settle

    faults.STAGE = stage
    # A killed earlier run of this stage left temporaries (or a version moved aside): settle
    # them first, so that a rerun starts from complete artifacts and leaves no debris.
    outputs = paths.stage_outputs(
        stage,
        run_dir,
        kwargs.get("iteration", 0),
        kwargs.get("worker", 0),
        int(cfg["rollout"]["workers"]),
    )
    for path in outputs:
        for p in settle(path):
            print(f"wamrl {stage}: settled {p} (left by an interrupted run)", file=sys.stderr)
    faults.point("start")
    module = importlib.import_module(f"stages.{stage}")
    module.main(cfg, run_dir, **kwargs)


@app.command()
def init(run_dir: RunDir = Path("."), configfile: ConfigFiles = None, set: Sets = None) -> None:
    """Iteration 0: base checkpoint, per-task text contexts, statistics."""
    run_stage("init", resolve(run_dir, configfile, set), run_dir, iteration=0)


@app.command()
def context(run_dir: RunDir = Path("."), configfile: ConfigFiles = None, set: Sets = None) -> None:
    """fastwam backend: each task's umT5 text context -> context/ (init reuses it)."""
    run_stage("context", resolve(run_dir, configfile, set), run_dir)


@app.command()
def demos(
    worker: Annotated[int, typer.Option("--worker", "-w", min=0)] = 0,
    run_dir: RunDir = Path("."),
    configfile: ConfigFiles = None,
    set: Sets = None,
) -> None:
    """One shard of scripted-expert demonstrations -> demos/shard_{w}.zarr."""
    run_stage("demos", resolve(run_dir, configfile, set), run_dir, worker=worker)


@app.command()
def sft(run_dir: RunDir = Path("."), configfile: ConfigFiles = None, set: Sets = None) -> None:
    """Supervised fine-tuning on demos/ -> sft/policy (a base for policy.base_checkpoint: sft)."""
    run_stage("sft", resolve(run_dir, configfile, set), run_dir)


@app.command()
def rollout(
    iter: Iter,
    worker: Annotated[int, typer.Option("--worker", "-w", min=0)] = 0,
    run_dir: RunDir = Path("."),
    configfile: ConfigFiles = None,
    set: Sets = None,
) -> None:
    """One rollout shard: iter_{n-1}/policy -> iter_n/rollouts/shard_{w}.zarr."""
    run_stage("rollout", resolve(run_dir, configfile, set), run_dir, iteration=iter, worker=worker)


def _iteration_command(stage: str, doc: str) -> None:
    def command(
        iter: Iter, run_dir: RunDir = Path("."), configfile: ConfigFiles = None, set: Sets = None
    ) -> None:
        run_stage(stage, resolve(run_dir, configfile, set), run_dir, iteration=iter)

    command.__doc__ = doc
    app.command(name=stage.replace("_", "-"))(command)


_iteration_command(
    "reward", "Imagined-future rewards, returns, advantages -> reward/ in every shard."
)
_iteration_command("actor", "PPO on the action expert -> iter_n/actor/.")
_iteration_command("world_model", "LoRA update of the video expert -> iter_n/world_model/.")
_iteration_command("merge", "Previous policy + new actor + new LoRA -> iter_n/policy/.")
_iteration_command("eval", "Deterministic eval on the LIBERO tasks -> iter_n/eval.json.")


@app.command()
def inspect(
    store: Path,
    quick: Annotated[bool, typer.Option(help="skip decompressing every image chunk")] = False,
) -> None:
    """Summarise and validate an episode store; exits 1 if it is invalid or half-written."""
    from wamrl.inspect import inspect_store

    raise typer.Exit(inspect_store(store, deep=not quick))


@app.command()
def verify(
    run_dir: Annotated[Path, typer.Argument(help="the run directory")],
    deep: Annotated[bool, typer.Option(help="also decompress every store chunk")] = False,
) -> None:
    """Check every artifact of a run (stores' checksums and contract, checkpoints' sha256,
    JSON and safetensors headers); exits 1 naming each damaged one (docs/integrity.md)."""
    from wamrl.verify import verify_run

    results = verify_run(run_dir, deep=deep)
    for name, problem in results:
        typer.echo(
            f"{'ok ' if problem is None else 'BAD'} {name}" + (f": {problem}" if problem else "")
        )
    bad = sum(problem is not None for _, problem in results)
    typer.echo(f"{len(results) - bad}/{len(results)} artifacts intact under {run_dir}")
    raise typer.Exit(1 if bad or not results else 0)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="the run directory (finished or still going)")],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="output folder (default RUN_DIR/report)")
    ] = None,
    video_iter: Annotated[
        list[int] | None,
        typer.Option(
            "--video-iter",
            help="iterations to cut episode videos from (repeatable; "
            "default: the first and last with rollout stores)",
        ),
    ] = None,
    videos: Annotated[int, typer.Option(help="successful and failed episodes per iteration")] = 2,
) -> None:
    """One self-contained HTML report of a run: curves, training health, per-task heatmap,
    episode videos, stage timing -> OUT/index.html (+ PNGs, mp4s, report.json)."""
    from wamrl.report import build_report

    index = build_report(run_dir, out, video_iter, videos)
    typer.echo(str(index))


@app.command()
def status(
    run_dir: Annotated[Path, typer.Argument(help="the run directory (finished or still going)")],
) -> None:
    """One screen on a run: per iteration the stages done, rollout success, groups kept,
    the actor's KL and early stop, eval success; then the next job the DAG would run."""
    from wamrl.status import print_status

    print_status(run_dir)


@app.command()
def compare(
    eval_a: Annotated[Path, typer.Argument(help="the first eval.json (e.g. the base's)")],
    eval_b: Annotated[Path, typer.Argument(help="the second eval.json (e.g. after RL)")],
    json_out: Annotated[bool, typer.Option("--json", help="print the comparison as JSON")] = False,
) -> None:
    """Per task and in all, B's success against A's: the unpaired two-proportion z and,
    where the evals' episodes pair (one protocol and eval seed), McNemar's paired test."""
    import json

    from wamrl.artifact import read_json
    from wamrl.compare import compare as compare_evals
    from wamrl.compare import table

    a, b = (read_json(p, "an eval.json", keys=("tasks",)) for p in (eval_a, eval_b))
    result = compare_evals(a, b)
    typer.echo(json.dumps(result, indent=1) if json_out else table(result, "A", "B"))


@app.command()
def config(run_dir: RunDir = Path("."), configfile: ConfigFiles = None, set: Sets = None) -> None:
    """Print the resolved, validated config."""
    sys.stdout.write(dump(resolve(run_dir, configfile, set)))


if __name__ == "__main__":
    app()
