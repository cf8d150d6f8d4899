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
#
# Under a default storage provider (--default-storage-provider, profiles/kubernetes) the run
# directory lives in storage: each job gets local copies of its declared inputs under
# .snakemake/storage/<provider>/..., and its declared outputs are uploaded from there. A
# stage then runs inside that local copy of the run dir (stage, run_dir_of) and sees only
# what its rule declares, so the rules also declare there what a plain run leaves implicit:
# the run's config (rule run_config), the previous actor's and world model's state, and
# iteration 0's policy for actor.ref_kl; the reward rule uploads the reward/ groups its
# stage writes into its input shards (in_storage). docs/clusters.md "Under a storage provider".
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


STORAGE = workflow.storage_settings.default_storage_provider is not None


def in_storage(path, local):
    """The run dir's `path` in the default storage, with the local file or folder `local`
    as its local copy: .store_object() uploads what Snakemake, which uploads a job's
    declared outputs only, would not."""
    prefix = (workflow.storage_settings.default_storage_prefix or "").rstrip("/")
    query = f"{prefix}/{path}" if prefix else str(path)  # as Snakemake prefixes an input
    obj = workflow.storage_registry.default_storage_provider.object(query)
    obj.set_local_path(Path(local))
    return obj


onstart:
    # Not on a dry run (-n): only a run that starts jobs records its config. (Nor with
    # --no-hooks: do not use it on a new run dir, whose stages would read the defaults.)
    if not (RUN_CFG.is_file() and RUN_CFG.read_text() == dump(CFG)):
        write_text(RUN_CFG, dump(CFG))
        # The stages read the stored copy (rule run_config makes the first): keep it the same.
        if STORAGE and (stored_config := in_storage(RUN_CONFIG, RUN_CFG)).exists():
            stored_config.store_object()

W = CFG["rollout"]["workers"]
GPU = 0 if CFG["device"] == "cpu" else 1
WAMRL = str(Path(sys.executable).with_name("wamrl")) if Path(sys.executable).with_name("wamrl").exists() else "wamrl"

wildcard_constraints:
    it=r"\d{3}",
    w=r"\d{3}",


def run_dir_of(depth):
    """params under a storage provider: `run`, the job's local copy of the run dir
    (.snakemake/storage/...), `depth` levels above its first output; none in a plain run,
    whose stages run in the run dir itself."""
    if not STORAGE:
        return {}
    return {"run": lambda wc, output: str(Path(output[0]).parents[depth - 1])}


def stored(*paths):
    """Inputs declared under a storage provider only: files a stage reads that a plain run
    finds in the run dir anyway. ancient(): they never make a finished job rerun."""
    return [ancient(p) for p in paths] if STORAGE else []


# Every stage reads the run's config (.wamrl/config.yaml, wamrl.cli.resolve).
CONFIG_INPUT = stored(str(RUN_CONFIG))


def stored_from_2(path):
    """stored(path), {it} in it meaning iteration n-1, for iterations n >= 2 only (iteration
    1 follows no update, and its previous policy is iteration 0's)."""
    return lambda wc: stored(path.format(it=prev(wc))) if int(wc.it) > 1 else []


def stage(args):
    """A stage's shell command, its output kept in the job's log. Under a storage provider
    it runs inside the job's local copy of the run dir (params.run, run_dir_of), so that the
    paths a stage records (relative to its run dir) read as in a plain run."""
    cmd = "{WAMRL} " + args + " --run-dir ."
    return ("(cd {params.run:q} && " + cmd + ")" if STORAGE else cmd) + " 2>&1 | tee {log}"


def prev(wc):
    return f"{int(wc.it) - 1:03d}"


def policy_of(n):
    # ancient(): a checkpoint of an earlier iteration counts as old, so rerunning one stage
    # of iteration n redoes n's downstream jobs, not every later iteration.
    return ancient(f"iter_{n}/policy")


def base_inputs(base):
    if base is None:
        return []
    if base == "sft":
        return ["sft/policy"]
    # local(): a file of this machine, not of the run's storage (under a storage provider
    # without a shared filesystem, init then runs where Snakemake runs)
    return [local(str(resolve_path(base) / "model.safetensors"))]


def every_eval():
    n, every = CFG["pipeline"]["iterations"], CFG["eval"]["every"]
    its = sorted({i for i in range(every, n + 1, every)} | {n})
    return [f"iter_{i:03d}/eval.json" for i in its]


rule all:
    input:
        every_eval(),


if STORAGE:

    rule run_config:
        # The stored copy of the run's config that the stages read (onstart keeps it in
        # step with .wamrl/config.yaml here).
        output:
            str(RUN_CONFIG),
        localrule: True
        run:
            write_text(Path(output[0]), dump(CFG))


rule init:
    input:
        # policy.base_checkpoint: sft trains the base here first (demos -> sft).
        base_inputs(CFG["policy"]["base_checkpoint"]),
        cfg=CONFIG_INPUT,
    output:
        directory("iter_000/policy"),
    params:
        **run_dir_of(2),
    log:
        "logs/iter_000/init.log",
    shell:
        stage("init")


rule demos:
    input:
        cfg=CONFIG_INPUT,
    output:
        directory("demos/shard_{w}.zarr"),
    threads: 1
    params:
        **run_dir_of(2),
    log:
        "logs/demos/shard_{w}.log",
    shell:
        stage("demos --worker {wildcards.w}")


rule sft:
    input:
        expand("demos/shard_{w:03d}.zarr", w=range(CFG["demos"]["workers"])),
        cfg=CONFIG_INPUT,
    output:
        directory("sft/policy"),
        "sft/log.json",
    resources:
        gpu=GPU,
    params:
        **run_dir_of(2),
    log:
        "logs/sft.log",
    shell:
        stage("sft")


def previous_rollouts(wc):
    # The plan's per-task rates come from iteration n-1's rollout success (wamrl.plan);
    # ancient(): rerunning n-1's rollouts alone does not redo every later iteration.
    n = int(wc.it) - 1
    return [ancient(f"iter_{n:03d}/rollouts/shard_{w:03d}.zarr") for w in range(W)] if n else []


rule rollout:
    input:
        policy=lambda wc: policy_of(prev(wc)),
        previous=previous_rollouts,
        cfg=CONFIG_INPUT,
    output:
        directory("iter_{it}/rollouts/shard_{w}.zarr"),
    threads: CFG["rollout"]["envs_per_worker"]
    resources:
        gpu=GPU,
    params:
        **run_dir_of(3),
    log:
        "logs/iter_{it}/rollout_{w}.log",
    shell:
        stage("rollout --iter {wildcards.it} --worker {wildcards.w}")


REWARD_INPUT = dict(
    shards=expand("iter_{{it}}/rollouts/shard_{w:03d}.zarr", w=range(W)),
    live=lambda wc: policy_of(prev(wc)),
    frozen=policy_of("000"),
    cfg=CONFIG_INPUT,
)

if not STORAGE:

    rule reward:
        input:
            **REWARD_INPUT,
        output:
            "iter_{it}/reward.done",
        resources:
            gpu=GPU,
        log:
            "logs/iter_{it}/reward.log",
        shell:
            stage("reward --iter {wildcards.it}")

else:
    # The stage writes reward/ into each shard, an input: here into the job's local copy,
    # which Snakemake never uploads, so the rule does (a `run` job only under storage).

    rule reward:
        input:
            **REWARD_INPUT,
        output:
            "iter_{it}/reward.done",
        resources:
            gpu=GPU,
        params:
            **run_dir_of(2),
        log:
            "logs/iter_{it}/reward.log",
        run:
            shell(stage("reward --iter {wildcards.it}"))
            for shard in input.shards:
                reward = Path(shard, "reward")
                in_storage(reward.relative_to(params.run), reward).store_object()


rule actor:
    input:
        "iter_{it}/reward.done",
        shards=expand("iter_{{it}}/rollouts/shard_{w:03d}.zarr", w=range(W)),
        policy=lambda wc: policy_of(prev(wc)),
        cfg=CONFIG_INPUT,
        # Adam's state (and master weights) carried over from the previous actor
        previous=stored_from_2("iter_{it}/actor"),
        # actor.ref_kl: the KL to iteration 0's actor
        ref=stored_from_2("iter_000/policy") if CFG["actor"]["ref_kl"] else [],
    output:
        directory("iter_{it}/actor"),
    resources:
        gpu=GPU * CFG["actor"]["devices"],  # actor.devices data-parallel ranks, a GPU each
    params:
        **run_dir_of(2),
    log:
        "logs/iter_{it}/actor.log",
    shell:
        stage("actor --iter {wildcards.it}")


rule world_model:
    # Independent of the actor: it reads only the video-SFT frames and changes only LoRA.
    input:
        shards=expand("iter_{{it}}/rollouts/shard_{w:03d}.zarr", w=range(W)),
        policy=lambda wc: policy_of(prev(wc)),
        frozen=policy_of("000"),
        cfg=CONFIG_INPUT,
        previous=stored_from_2("iter_{it}/world_model"),  # the carried Sigma estimates
    output:
        directory("iter_{it}/world_model"),
    resources:
        gpu=GPU,
    params:
        **run_dir_of(2),
    log:
        "logs/iter_{it}/world_model.log",
    shell:
        stage("world-model --iter {wildcards.it}")


rule merge:
    input:
        "iter_{it}/actor",
        "iter_{it}/world_model",
        policy=lambda wc: policy_of(prev(wc)),
        cfg=CONFIG_INPUT,
    output:
        directory("iter_{it,(?!000)\\d{3}}/policy"),
    params:
        **run_dir_of(2),
    log:
        "logs/iter_{it}/merge.log",
    shell:
        stage("merge --iter {wildcards.it}")


rule eval:
    input:
        "iter_{it}/policy",
        cfg=CONFIG_INPUT,
    output:
        "iter_{it}/eval.json",
        # eval.videos under a storage provider: the mp4s, else left in the job's local copy
        *([directory("iter_{it}/eval_videos")] if STORAGE and CFG["eval"]["videos"] else []),
    threads: CFG["eval"]["envs"]
    resources:
        gpu=GPU,
    params:
        **run_dir_of(2),
    log:
        "logs/iter_{it}/eval.log",
    shell:
        stage("eval --iter {wildcards.it}")


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
