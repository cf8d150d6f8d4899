"""Config loading: defaults, overrides, and errors that name the key."""

from __future__ import annotations

import pytest

from wamrl.config import DEFAULT_CONFIG, ConfigError, load_config, parse_overrides, read_yaml


def test_default_is_valid_and_complete():
    cfg = load_config()
    assert cfg == read_yaml(DEFAULT_CONFIG)
    assert cfg["sampler"] == {
        "K": 8,
        "noise_a": 0.5,
        "shift": 5.0,
        "cuda_graphs": True,
        "amp": None,
        "max_batch": None,
        "compile": False,
    }
    assert (cfg["actor"]["amp"], cfg["actor"]["logp_old"]) == (None, "rollout")


def test_seed_table_defaults_match_the_design():
    cfg = load_config()
    assert cfg["actor"]["clip_low"] == cfg["actor"]["clip_high"] == 0.2
    assert (cfg["actor"]["epochs"], cfg["actor"]["minibatch"], cfg["actor"]["lr"]) == (2, 64, 1e-5)
    assert (cfg["world_model"]["lora_rank"], cfg["world_model"]["lr"]) == (64, 5e-5)
    assert (cfg["reward"]["beta"], cfg["reward"]["gamma"], cfg["reward"]["gamma_libero_10"]) == (
        0.1,
        0.99,
        0.995,
    )
    assert (cfg["world_model"]["kl_weight"], cfg["world_model"]["ema"], cfg["eval"]["K"]) == (
        0.1,
        0.99,
        20,
    )
    assert cfg["actor"]["ref_kl"] == 0.0 and cfg["reward"]["filter"] == "all_same"


def test_overrides_merge_deeply(tmp_path):
    f = tmp_path / "over.yaml"
    f.write_text("actor: {lr: 3.0e-5}\n")
    cfg = load_config([f], parse_overrides(["sampler.K=10", "eval.suites=[libero_10]"]))
    assert cfg["actor"]["lr"] == 3e-5 and cfg["actor"]["epochs"] == 2
    assert cfg["sampler"]["K"] == 10 and cfg["eval"]["suites"] == ["libero_10"]


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"actor.lrr": 1e-4}, "actor.lrr: unknown key"),
        ({"actor.lr": "fast"}, "actor.lr: 'fast' is not of type 'number'"),
        ({"sampler.noise_a": -0.5}, "sampler.noise_a"),
        ({"reward.world_model": "dream"}, "reward.world_model"),
        ({"rollout.group_size": 1}, "rollout.group_size"),
        ({"bogus": 1}, "bogus: unknown key"),
    ],
)
def test_errors_name_the_key(override, named):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=override)
    assert named in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config([tmp_path / "nope.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config([bad])


@pytest.mark.parametrize("key", ["sampler.amp", "actor.amp"])
def test_bf16_needs_the_learner_to_recompute_log_pi_old(key: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}: half precision needs actor.logp_old: recompute"):
        load_config(overrides={key: "bf16"})
    cfg = load_config(overrides={key: "bf16", "actor.logp_old": "recompute"})
    assert cfg["actor"]["logp_old"] == "recompute"


def test_fastwam_bf16_weights_come_with_a_recomputed_log_pi_old() -> None:
    fastwam = DEFAULT_CONFIG.parent / "fastwam.yaml"
    assert load_config([fastwam])["actor"]["logp_old"] == "recompute"
    with pytest.raises(ConfigError, match="policy.fastwam.dtype: half precision"):
        load_config([fastwam], {"actor.logp_old": "rollout"})
    cfg = load_config([fastwam], {"actor.logp_old": "rollout", "policy.fastwam.dtype": "float32"})
    assert cfg["actor"]["logp_old"] == "rollout"
