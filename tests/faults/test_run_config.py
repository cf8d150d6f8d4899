"""A run keeps its config (#22 item 6): the Snakefile refuses a changed config for an existing
run dir (showing what differs) unless --config force_config=true, a dry run never writes it,
and stages refuse inputs made under other values of what those inputs depend on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.stores import TV, K, T, make_episodes, store_attrs
from wamrl import paths
from wamrl.config import RUN_CONFIG, ConfigError, dump, load_config
from wamrl.store import ShardWriter, write_reward_group

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "1"]


def snakemake(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, *args], cwd=run, capture_output=True, text=True, timeout=600)


def started(run: Path, **over) -> str:
    """A run dir whose .wamrl/config.yaml was recorded under `over`."""
    text = dump(load_config(overrides=over))
    (run / RUN_CONFIG).parent.mkdir(parents=True)
    (run / RUN_CONFIG).write_text(text)
    return text


def test_dry_run_never_writes_the_config(tmp_path: Path) -> None:
    p = snakemake(tmp_path, "-n", "--config", "reward={beta: 0.5}", "--", "iter_001/eval.json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert not (tmp_path / RUN_CONFIG).exists()


def test_a_changed_config_is_refused_with_what_differs(tmp_path: Path) -> None:
    text = started(tmp_path)
    for dry in (["-n"], []):
        p = snakemake(tmp_path, *dry, "--config", "reward={beta: 0.5}", "--", "iter_001/eval.json")
        assert p.returncode != 0
        out = p.stdout + p.stderr
        assert "reward.beta: 0.1 -> 0.5" in out and "force_config=true" in out
        assert str(tmp_path / RUN_CONFIG) in out
    assert (tmp_path / RUN_CONFIG).read_text() == text
    assert not (tmp_path / "iter_000").exists()


def test_resuming_without_the_original_options_keeps_the_run_config(tmp_path: Path) -> None:
    # The run was started with 3 rollout workers (say by a --configfile not passed now).
    text = started(tmp_path, rollout={"workers": 3, "groups": 3})
    p = snakemake(tmp_path, "-n", "iter_001/eval.json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "rollout              3" in p.stdout or "rollout 3" in " ".join(p.stdout.split())
    # pipeline.* only picks targets: a resumed run may extend itself.
    p = snakemake(tmp_path, "-n", "--config", "pipeline={iterations: 7}", "--", "all")
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / RUN_CONFIG).read_text() == text


def test_garbage_run_config_is_a_named_error_before_any_job(tmp_path: Path) -> None:
    (tmp_path / RUN_CONFIG).parent.mkdir(parents=True)
    (tmp_path / RUN_CONFIG).write_text("rollout: [1, 2\n  ::: not yaml")
    p = snakemake(tmp_path, "iter_000/policy")
    assert p.returncode != 0
    assert str(tmp_path / RUN_CONFIG) in p.stdout + p.stderr
    assert "force_config=true" in p.stdout + p.stderr
    assert not (tmp_path / "iter_000").exists()


def test_force_config_replaces_the_run_config_when_jobs_start(tmp_path: Path) -> None:
    started(tmp_path)
    micro = str(REPO / "tests" / "micro.yaml")
    args = ["--configfile", micro, "--config", "force_config=true", "reward={beta: 0.5}"]
    p = snakemake(tmp_path, "-n", *args, "--", "iter_000/policy")
    assert p.returncode == 0, p.stderr[-2000:]
    assert yaml.safe_load((tmp_path / RUN_CONFIG).read_text())["reward"]["beta"] == 0.1
    p = snakemake(tmp_path, *args, "--", "iter_000/policy")
    assert p.returncode == 0, p.stderr[-2000:]
    recorded = yaml.safe_load((tmp_path / RUN_CONFIG).read_text())
    assert recorded["reward"]["beta"] == 0.5 and recorded["rollout"]["group_size"] == 2
    assert "force_config" not in recorded
    assert (paths.policy_dir(tmp_path, 0) / "model.safetensors").is_file()


# ---- stages check their inputs ---------------------------------------------------------------


def shard(run: Path, w: int, cfg: dict) -> Path:
    path = paths.shard_path(run, 1, w)
    attrs = {**store_attrs(), "shard": w, "G": cfg["rollout"]["group_size"], "config": cfg}
    episodes = make_episodes(w)
    with ShardWriter(path, len(episodes), T, K, TV, attrs) as writer:
        for i, ep in enumerate(episodes):
            writer.write_episode(i, ep)
    return path


def cfg_with(**over) -> dict:
    return load_config(overrides={"rollout": {"workers": 2, "groups": 2}, **over})


def test_reward_stage_refuses_shards_of_another_group_size(tmp_path: Path) -> None:
    import stages.reward

    cfg = cfg_with(rollout={"workers": 2, "groups": 2, "group_size": 4})
    shard(tmp_path, 0, cfg)
    other = shard(tmp_path, 1, cfg_with(rollout={"workers": 2, "groups": 2, "group_size": 2}))
    with pytest.raises(ConfigError, match=r"rollout.group_size: 2 -> 4") as e:
        stages.reward.main(cfg, tmp_path, 1)
    assert str(other) in str(e.value)
    assert not paths.reward_done(tmp_path, 1).exists()
    assert not (other / "reward").exists()


def _reward(path: Path, cfg: dict) -> None:
    E = len(make_episodes())
    arrays = {n: np.zeros((E, T), np.float32) for n in ("r_rec", "r_rec_norm", "reward")}
    arrays |= {"return": np.zeros((E, T), np.float32), "advantage": np.zeros((E, T), np.float32)}
    attrs = {"beta": 0.1, "gamma": 0.99, "rec_mean": 0, "rec_std": 1, "world_model": {}}
    write_reward_group(path, arrays, np.ones(E, bool), {**attrs, "config": cfg})


@pytest.mark.parametrize("where", ["reward.done", "shard"])
def test_actor_refuses_rewards_made_with_another_beta(where: str, tmp_path: Path) -> None:
    import stages.actor

    cfg = cfg_with()
    beta5 = cfg_with(reward={"beta": 0.5})
    for w in range(2):
        _reward(shard(tmp_path, w, cfg), beta5 if (where == "shard" and w == 1) else cfg)
    done = paths.reward_done(tmp_path, 1)
    done.write_text(json.dumps({"config": beta5 if where == "reward.done" else cfg}))
    with pytest.raises(ConfigError, match=r"reward.beta: 0.5 -> 0.1") as e:
        stages.actor.main(cfg, tmp_path, 1)
    culprit = done if where == "reward.done" else paths.shard_path(tmp_path, 1, 1) / "reward"
    assert str(culprit) in str(e.value)
    assert not paths.actor_dir(tmp_path, 1).exists()


def test_world_model_refuses_shards_of_another_sampler(tmp_path: Path) -> None:
    import stages.world_model

    cfg = cfg_with()
    shard(tmp_path, 0, cfg)
    shard(tmp_path, 1, cfg_with(sampler={"noise_a": 0.7}))
    with pytest.raises(ConfigError, match=r"sampler.noise_a: 0.7 -> 0.5"):
        stages.world_model.main(cfg, tmp_path, 1)
    assert not paths.world_model_dir(tmp_path, 1).exists()


def test_speed_knobs_do_not_count_as_another_config(tmp_path: Path) -> None:
    from wamrl.store import check_made_under

    path = shard(tmp_path, 0, cfg_with())
    faster = cfg_with(rollout={"workers": 2, "groups": 2, "envs_per_worker": 8})
    faster["reward"]["imagine_batch"] = 256
    check_made_under([path], faster)  # no error
