"""Config edges (#22 item 8): values the schema accepts are values the code runs, and the
ones it cannot run are refused at config load, naming the key."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wamrl import paths
from wamrl.config import ConfigError, coerce_strings, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text", ["1e-5", "1E-5", "+1e-5", "1.0e-5", "10e-6"])
def test_exponent_floats_are_floats_in_set_and_config_files(tmp_path: Path, text: str) -> None:
    """YAML 1.1 reads 1e-5 (no dot) as a string: `--set actor.lr=1e-5` was refused."""
    cfg = load_config(overrides=parse_overrides([f"actor.lr={text}"]))
    assert cfg["actor"]["lr"] == pytest.approx(1e-5) and isinstance(cfg["actor"]["lr"], float)
    f = tmp_path / "c.yaml"
    f.write_text(f"actor:\n  lr: {text}\nworld_model: {{lr: {text}}}\n")
    cfg = load_config([f])
    assert cfg["actor"]["lr"] == pytest.approx(1e-5) == cfg["world_model"]["lr"]
    # what is not a number stays a string, and a string is still refused where a number goes
    assert parse_overrides(["policy.stats=1e-5.json"])["policy"]["stats"] == "1e-5.json"
    with pytest.raises(ConfigError, match="actor.lr: 'e-5' is not of type 'number'"):
        load_config(overrides=parse_overrides(["actor.lr=e-5"]))


def test_snakemake_config_values_are_typed() -> None:
    # Snakemake hands nested --config values over as strings: the Snakefile coerces them.
    cfg = load_config(overrides=coerce_strings({"actor": {"lr": "1e-5", "epochs": "3"}}))
    assert (cfg["actor"]["lr"], cfg["actor"]["epochs"]) == (1e-5, 3)


def test_snakemake_config_flag_with_an_exponent_float(tmp_path: Path) -> None:
    """README's form, `--config 'actor={lr: 1e-5}' -- TARGET` (the `--` ends --config's
    values), passes the schema (a number) and plans the DAG; a value that is no number is
    refused, naming the key, before any job."""

    def plan(value: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-n", "--cores",
            "1", "--config", f"actor={{lr: {value}}}", "--", "iter_001/eval.json",
        ]  # fmt: skip
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)

    p = plan("1e-5")
    assert p.returncode == 0, p.stderr[-3000:]
    p = plan("1e-5x")
    assert p.returncode != 0 and "actor.lr" in p.stdout + p.stderr


def test_documented_commands_end_config_values_before_the_target() -> None:
    """--config and --configfile take several values: without `--`, Snakemake reads the
    target as one more ("Unparsable value: 'iter_001/eval.json'", "No such file: 'all'")."""
    docs = [ROOT / "README.md", *ROOT.glob("configs/*.yaml"), *ROOT.glob("profiles/*/config.yaml")]
    for f in docs:
        for line in f.read_text().splitlines():
            if "snakemake " in line and "--config" in line:
                assert " -- " in line, f"{f.name}: {line}"


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"eval.tasks": []}, r"eval.tasks: \[\] should be non-empty"),
        (
            {"eval.tasks": [0, 39], "eval.suites": ["libero_spatial"]},
            r"eval.tasks: \[39\] are not tasks of eval.suites \['libero_spatial'\]",
        ),
        (
            {"rollout.tasks": [3], "rollout.suites": ["libero_object"]},
            r"rollout.tasks: \[3\] are not tasks of rollout.suites \['libero_object'\]",
        ),
        ({"demos.tasks": []}, r"demos.tasks: \[\] should be non-empty"),
        (
            {"demos.tasks": [12], "demos.suites": ["libero_10"]},
            r"demos.tasks: \[12\] are not tasks of demos.suites",
        ),
    ],
)
def test_task_selections_outside_their_suites_are_refused_at_load(over, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=over)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"policy.backend": "fastwam"}, "policy.fastwam: required with policy.backend fastwam"),
        ({"sampler.compile": True, "sampler.cuda_graphs": False}, "sampler.compile: needs"),
    ],
)
def test_settings_the_code_would_ignore_or_crash_on_are_refused(over, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=over)


def test_task_selections_inside_their_suites_load() -> None:
    cfg = load_config(overrides={"eval.tasks": [0, 9], "eval.suites": ["libero_spatial"]})
    assert cfg["eval"]["tasks"] == [0, 9]


def test_world_model_epochs_zero_runs_the_stage_and_says_so(run_after_reward) -> None:
    import stages.world_model
    from wamrl.artifact import load_tensors

    run, cfg = run_after_reward
    cfg = {**cfg, "world_model": {**cfg["world_model"], "epochs": 0}}
    stages.world_model.main(cfg, run, 1)
    out = paths.world_model_dir(run, 1)
    metrics = json.loads((out / "metrics.json").read_text())
    assert "epochs is 0" in metrics["skipped"]
    before = load_tensors(paths.policy_dir(run, 0) / "model.safetensors")
    lora = load_tensors(out / "lora.safetensors")
    assert lora and all(torch.equal(v, before[k]) for k, v in lora.items())


def test_actor_metrics_say_when_adam_starts_from_zero(run_after_reward, tmp_path: Path) -> None:
    """Iteration 2 restores iteration 1's Adam state; without it, metrics say
    optimizer_reset instead of a silent reset."""
    import stages.actor

    run, cfg = run_after_reward
    stages.actor.main(cfg, run, 1)
    m1 = json.loads((paths.actor_dir(run, 1) / "metrics.json").read_text())
    assert m1["optimizer_reset"] is False and m1["optimizer_state_from"] is None

    # iteration 2 on copies of iteration 1's inputs: rollouts, reward.done, a policy
    two = tmp_path / "run"
    shutil.copytree(run, two)
    shutil.copytree(paths.iter_dir(two, 1) / "rollouts", paths.iter_dir(two, 2) / "rollouts")
    shutil.copy(paths.reward_done(two, 1), paths.reward_done(two, 2))
    shutil.copytree(paths.policy_dir(two, 0), paths.policy_dir(two, 1))
    stages.actor.main(cfg, two, 2)
    m2 = json.loads((paths.actor_dir(two, 2) / "metrics.json").read_text())
    assert m2["optimizer_reset"] is False and m2["optimizer_state_restored_params"] > 0
    assert m2["optimizer_state_from"].endswith("iter_001/actor/optimizer.safetensors")

    shutil.rmtree(paths.actor_dir(two, 1))
    stages.actor.main(cfg, two, 2)
    m2 = json.loads((paths.actor_dir(two, 2) / "metrics.json").read_text())
    assert m2["optimizer_reset"] is True and m2["optimizer_state_restored_params"] == 0


def test_every_shipped_config_loads() -> None:
    for f in sorted((ROOT / "configs").glob("*.yaml")):
        if f.name != "schema.yaml":
            load_config([f])
    load_config([ROOT / "tests" / "micro.yaml"])
    assert os.path.isfile(ROOT / "configs" / "schema.yaml")
