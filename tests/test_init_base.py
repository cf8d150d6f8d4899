"""init with a base checkpoint: the shipped base loads, a base of other dims is refused."""

from __future__ import annotations

import copy

import pytest

from stages.init import check_base_matches
from wamrl.config import load_config, resolve_path


def test_shipped_base_matches_the_default_config() -> None:
    cfg = load_config()
    base = resolve_path(cfg["policy"]["base_checkpoint"])
    assert (base / "model.safetensors").is_file() and (base / "stats.json").is_file()
    check_base_matches(cfg["policy"], base)


def test_base_of_other_dims_is_refused_with_the_differing_keys() -> None:
    cfg = load_config()
    policy = copy.deepcopy(cfg["policy"])
    layers = policy["tiny"]["layers"]  # the shipped base has the default dims
    policy["tiny"]["layers"] = layers + 2
    with pytest.raises(ValueError, match=rf"layers: config {layers + 2} vs checkpoint {layers}"):
        check_base_matches(policy, resolve_path(cfg["policy"]["base_checkpoint"]))
    policy["backend"] = "fastwam"
    with pytest.raises(ValueError, match="is a 'tiny' model"):
        check_base_matches(policy, resolve_path(cfg["policy"]["base_checkpoint"]))
