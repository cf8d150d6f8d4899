"""configs/README.md, the config reference, is what scripts/config_reference.py makes of
configs/schema.yaml and configs/default.yaml: regenerate it and compare."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "config_reference.py"
_spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)


def test_config_reference_is_current() -> None:
    current = ref.README.read_text()
    assert ref.MARKER in current
    assert current == ref.render(current), (
        "configs/README.md is stale: run python scripts/config_reference.py"
    )


def test_every_key_has_a_description() -> None:
    assert ref.undescribed() == [], "describe these keys in configs/schema.yaml"


def test_one_row_per_key_path() -> None:
    text = ref.README.read_text()
    for path in (
        "seed",
        "sampler.K",
        "policy.tiny.video_dim",
        "policy.fastwam.arch.eps",
        "rollout.fixed_batch",
        "pipeline.iterations",
    ):
        assert text.count(f"| `{path}` |") == 1, path
    assert "| `actor.lr` | number > 0 | `1e-5` |" in text


def test_types_and_values() -> None:
    defs = {"posint": {"type": "integer", "minimum": 1}}
    assert ref.type_of({"$ref": "#/$defs/posint"}, defs) == "integer ≥ 1"
    assert ref.type_of({"enum": [None, "bf16"]}, defs) == "null | bf16"
    assert ref.type_of({"type": ["null", "number"], "exclusiveMinimum": 0}, defs) == (
        "null or number > 0"
    )
    assert ref.scalar(1.0e-5) == "1e-5" and ref.scalar([1, None, True]) == "[1, null, true]"
    assert ref.cell("a|b*c") == "a\\|b\\*c"
