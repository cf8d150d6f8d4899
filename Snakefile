# wamrl: one RL iteration is a DAG of stage commands over on-disk artifacts.
#
#   snakemake --cores all iter_042/eval.json          run or resume 42 iterations, score the last
#   snakemake --cores all -f iter_003/reward.done     rerun one stage on saved rollouts
#   snakemake --cores all all                         pipeline.iterations, eval every eval.every
#
# Config: configs/default.yaml, then --configfile files, then --config 'section={key: value}';
# validated against configs/schema.yaml before any job. The resolved config is written to
# .wamrl/config.yaml in the run directory, where every stage command reads it. A run keeps
# that config: later commands start from it (resuming needs no --configfile), a command that
# would change it is refused with the differences (pipeline.* excepted: it only picks
# targets), and `--config force_config=true` replaces
# it with this command's config (defaults, --configfile, --config). Dry runs never write it.
# Every job also keeps its output in logs/ (logs/iter_NNN/<rule>.log): Snakemake names that
# file when a job fails, on a cluster too.
import sys
from pathlib import Path

from wamrl.config import (
    FREE_KEYS, RUN_CONFIG, ConfigError, coerce_strings, config_diff, dump, expand_dotted,
    load_config, read_yaml, resolve_path
)
from wamrl.atomic import write_text

# Iteration n depends on n-1 for every n: building the DAG of hundreds of iterations
# recurses that deep, beyond Python's default limit.
sys.setrecursionlimit(max(sys.getrecursionlimit(), 200_000))

FORCE_CONFIG = coerce_strings(config.pop("force_config", False)) is True
RUN_CFG = Path(RUN_CONFIG).absolute()
try:
    recorded = read_yaml(RUN_CFG) if RUN_CFG.is_file() and not FORCE_CONFIG else None
    base = [RUN_CFG] if recorded is not None else []
    CFG = load_config(base, overrides=expand_dotted(coerce_strings(config)))
except ConfigError as e:
    hint = (
        f"\n{RUN_CFG} is this run's config: restore it, or replace it with this command's "
        "config by adding --config force_config=true"
        if str(RUN_CFG) in str(e) else ""
    )
    raise WorkflowError(f"{e}{hint}") from None
if recorded is not None and (diff := config_diff(recorded, CFG, ignore=FREE_KEYS)):
    raise WorkflowError(
        f"{RUN_CFG}: this run was started under another config, and its jobs must not mix "
        "two. This command would change (run -> command):\n  " + "\n  ".join(diff)
        + "\nResume without those options (the run's config is read from that file), or add "
        "--config force_config=true to make this command's config the run's (finished "
        "artifacts keep theirs; stages refuse inputs made under different values)."
    )


onstart:
    # Not on a dry run (-n): only a run that starts jobs records its config. (Nor with
    # --no-hooks: do not use it on a new run dir, whose stages would read the defaults.)
    if not (RUN_CFG.is_file() and RUN_CFG.read_text() == dump(CFG)):
        write_text(RUN_CFG, dump(CFG))

W = CFG["rollout"]["workers"]
GPU = 0 if CFG["device"] == "cpu" else 1
WAMRL = str(Path(sys.executable).with_name("wamrl")) if Path(sys.executable).with_name("wamrl").exists() else "wamrl"

wildcard_constraints:
    it=r"\d{3}",
    w=r"\d{3}",


def prev(wc):
    return f"{int(wc.it) - 1:03d}"


def policy_of(n):
    # ancient(): a checkpoint of an earlier iteration counts as old, so rerunning one stage
    # of iteration n redoes n's downstream jobs, not every later iteration.
    return ancient(f"iter_{n}/policy")


def base_inputs(base):
    if base is None:
        return []
    return ["sft/policy"] if base == "sft" else [str(resolve_path(base) / "model.safetensors")]


def every_eval():
    n, every = CFG["pipeline"]["iterations"], CFG["eval"]["every"]
    its = sorted({i for i in range(every, n + 1, every)} | {n})
    return [f"iter_{i:03d}/eval.json" for i in its]


rule all:
    input:
        every_eval(),


rule init:
    input:
        # policy.base_checkpoint: sft trains the base here first (demos -> sft).
        base_inputs(CFG["policy"]["base_checkpoint"]),
    output:
        directory("iter_000/policy"),
    log:
        "logs/iter_000/init.log",
    shell:
        "{WAMRL} init --run-dir . 2>&1 | tee {log}"


rule demos:
    output:
        directory("demos/shard_{w}.zarr"),
    threads: 1
    log:
        "logs/demos/shard_{w}.log",
    shell:
        "{WAMRL} demos --worker {wildcards.w} --run-dir . 2>&1 | tee {log}"


rule sft:
    input:
        expand("demos/shard_{w:03d}.zarr", w=range(CFG["demos"]["workers"])),
    output:
        directory("sft/policy"),
        "sft/log.json",
    resources:
        gpu=GPU,
    log:
        "logs/sft.log",
    shell:
        "{WAMRL} sft --run-dir . 2>&1 | tee {log}"


def previous_rollouts(wc):
    # The plan's per-task rates come from iteration n-1's rollout success (wamrl.plan);
    # ancient(): rerunning n-1's rollouts alone does not redo every later iteration.
    n = int(wc.it) - 1
    return [ancient(f"iter_{n:03d}/rollouts/shard_{w:03d}.zarr") for w in range(W)] if n else []


rule rollout:
    input:
        policy=lambda wc: policy_of(prev(wc)),
        previous=previous_rollouts,
    output:
        directory("iter_{it}/rollouts/shard_{w}.zarr"),
    threads: CFG["rollout"]["envs_per_worker"]
    resources:
        gpu=GPU,
    log:
        "logs/iter_{it}/rollout_{w}.log",
    shell:
        "{WAMRL} rollout --iter {wildcards.it} --worker {wildcards.w} --run-dir . 2>&1 | tee {log}"


rule reward:
    input:
        shards=expand("iter_{{it}}/rollouts/shard_{w:03d}.zarr", w=range(W)),
        live=lambda wc: policy_of(prev(wc)),
        frozen=policy_of("000"),
    output:
        "iter_{it}/reward.done",
    resources:
        gpu=GPU,
    log:
        "logs/iter_{it}/reward.log",
    shell:
        "{WAMRL} reward --iter {wildcards.it} --run-dir . 2>&1 | tee {log}"


rule actor:
    input:
        "iter_{it}/reward.done",
        shards=expand("iter_{{it}}/rollouts/shard_{w:03d}.zarr", w=range(W)),
        policy=lambda wc: policy_of(prev(wc)),
    output:
        directory("iter_{it}/actor"),
    resources:
        gpu=GPU * CFG["actor"]["devices"],  # actor.devices data-parallel ranks, a GPU each
    log:
        "logs/iter_{it}/actor.log",
    shell:
        "{WAMRL} actor --iter {wildcards.it} --run-dir . 2>&1 | tee {log}"


rule world_model:
    # Independent of the actor: it reads only the video-SFT frames and changes only LoRA.
    input:
        shards=expand("iter_{{it}}/rollouts/shard_{w:03d}.zarr", w=range(W)),
        policy=lambda wc: policy_of(prev(wc)),
        frozen=policy_of("000"),
    output:
        directory("iter_{it}/world_model"),
    resources:
        gpu=GPU,
    log:
        "logs/iter_{it}/world_model.log",
    shell:
        "{WAMRL} world-model --iter {wildcards.it} --run-dir . 2>&1 | tee {log}"


rule merge:
    input:
        "iter_{it}/actor",
        "iter_{it}/world_model",
        policy=lambda wc: policy_of(prev(wc)),
    output:
        directory("iter_{it,(?!000)\\d{3}}/policy"),
    log:
        "logs/iter_{it}/merge.log",
    shell:
        "{WAMRL} merge --iter {wildcards.it} --run-dir . 2>&1 | tee {log}"


rule eval:
    input:
        "iter_{it}/policy",
    output:
        "iter_{it}/eval.json",
    threads: CFG["eval"]["envs"]
    resources:
        gpu=GPU,
    log:
        "logs/iter_{it}/eval.log",
    shell:
        "{WAMRL} eval --iter {wildcards.it} --run-dir . 2>&1 | tee {log}"


# `snakemake report_html`: the run's HTML report (wamrl report) once every eval of `all` is
# done; `wamrl report .` also works any time on a run still going.
rule report_html:
    input:
        every_eval(),
    output:
        "report/index.html",
    localrule: True
    log:
        "logs/report.log",
    shell:
        "{WAMRL} report . --out report 2>&1 | tee {log}"
