"""configs/ablations: each variant validates over the GPU recipe and changes exactly what its
README row says (one key; wm_frozen also turns the world-model update on, kl_half halves both
KL bounds); scripts/ablate_gpu.sh refuses an unknown variant before it starts anything."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from wamrl.config import load_config

ROOT = Path(__file__).parents[1]
ABL = ROOT / "configs" / "ablations"


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_the_script_runs_every_variant_and_each_changes_one_thing() -> None:
    names = re.search(r"names=\((recipe[^)]*)\)", (ROOT / "scripts/ablate_gpu.sh").read_text())
    assert names, "ablate_gpu.sh lists its default variants"
    variants = names.group(1).split()[1:]
    assert sorted(variants) == sorted(p.stem for p in ABL.glob("*.yaml"))
    recipe = _flat(load_config([ROOT / "configs/rl_gpu.yaml"]))
    rows = dict(
        re.findall(r"^\| `(\w+)\.yaml` \| ([^|]*)\|", (ABL / "README.md").read_text(), re.M)
    )
    for name in variants:
        cfg = _flat(load_config([ROOT / "configs/rl_gpu.yaml", ABL / f"{name}.yaml"]))
        changed = {k for k in recipe if cfg[k] != recipe[k]}
        assert changed == set(re.findall(r"`([\w.]+):", rows[name])), name
        assert len(changed) == 1 or name in {"wm_frozen", "kl_half"}, f"{name}: {changed}"


def test_an_unknown_variant_is_refused_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "abl"
    r = subprocess.run(
        ["bash", str(ROOT / "scripts/ablate_gpu.sh"), str(out), "2", "beta0", "nope"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "configs/ablations/nope.yaml" in r.stderr
    assert not out.exists()


def test_the_table_pairs_each_variant_with_the_base_and_the_recipe(tmp_path: Path) -> None:
    import shutil

    v9 = ROOT / "data" / "rl_object_v9"
    shutil.copytree(v9, tmp_path / "recipe")
    shutil.copytree(v9, tmp_path / "same")
    (tmp_path / "late" / ".wamrl").mkdir(parents=True)
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts/ablation_table.py"), str(tmp_path), "4",
         "--base", str(v9 / "iter_000" / "eval.json")],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines()[2:]}
    assert list(rows) == ["base", "`recipe`", "`late`", "`same`"]
    # v9's policy 4: 122 of 200 (0.610); paired with the base 22 won, 13 lost (McNemar p 0.18)
    assert "0.610 [0.54, 0.67] | 22 / 13 (p = 0.18)" in rows["`recipe`"]
    assert "| 0 / 0 (p = 1) |" in rows["`same`"]  # the recipe's own episodes: no discordant one
    assert "37/160, 43/160, 55/160, 43/160" in rows["`same`"]
    assert "not finished" in rows["`late`"]


def test_the_figure_draws_the_finished_variants_and_refuses_none(tmp_path: Path) -> None:
    import shutil

    v9 = ROOT / "data" / "rl_object_v9"
    shutil.copytree(v9, tmp_path / "abl" / "recipe")
    (tmp_path / "abl" / "late" / ".wamrl").mkdir(parents=True)
    png = tmp_path / "abl.png"
    cmd = [sys.executable, str(ROOT / "scripts/ablation_table.py"), str(tmp_path / "abl"), "4",
           "--base", str(v9 / "iter_000" / "eval.json"), "--png", str(png)]  # fmt: skip
    subprocess.run(cmd, capture_output=True, timeout=60, check=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shutil.rmtree(tmp_path / "abl" / "recipe")
    png.unlink()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no variant" in r.stderr and not png.exists()
