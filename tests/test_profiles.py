"""profiles/slurm and profiles/kubernetes without a cluster, and docker/Dockerfile against CI.

What needs no cluster: both profiles parse and name only real rules and sane resources, the
DAG plans with each (`snakemake -n`, skipped where the executor plugin is missing), and the
image recipe installs what .ci/run installs. The SLURM run itself is tests/test_slurm.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "profiles" / "slurm" / "config.yaml"
K8S = REPO / "profiles" / "kubernetes" / "config.yaml"
GPU_RULES = {"sft", "rollout", "reward", "actor", "world_model", "eval"}


def rules() -> set[str]:
    # indented: a rule defined in an `if` (the reward rule, by storage provider)
    return set(re.findall(r"^\s*rule (\w+):", (REPO / "Snakefile").read_text(), re.M))


def load(p: Path) -> dict:
    cfg = yaml.safe_load(p.read_text())
    assert isinstance(cfg, dict)
    return cfg


@pytest.mark.parametrize("profile", [SLURM, K8S], ids=["slurm", "kubernetes"])
def test_profile_parses_and_names_real_rules(profile):
    cfg = load(profile)
    assert cfg["rerun-triggers"] == "mtime"  # as profiles/default
    assert cfg["rerun-incomplete"] is True
    assert cfg["retries"] >= 1 and cfg["jobs"] >= 1 and cfg["latency-wait"] >= 30
    assert set(cfg["set-resources"]) <= rules(), set(cfg["set-resources"]) - rules()
    for rule, res in cfg["set-resources"].items():
        assert "mem_mb" in res, rule
        if rule in {"init", "merge", "demos"}:
            assert "gpu" not in res, f"{rule} runs on CPU"
        # actor: the Snakefile asks for actor.devices GPUs; a fixed 1 here would override it
        if rule in GPU_RULES - {"actor"}:
            assert res["gpu"] == 1, rule
    assert "actor" not in cfg["set-resources"] or "gpu" not in cfg["set-resources"]["actor"]


def test_slurm_profile():
    cfg = load(SLURM)
    assert cfg["executor"] == "slurm"
    sr = cfg["set-resources"]
    for rule in ("rollout", "eval"):  # one CPU per env: the rules' threads
        assert sr[rule]["cpus_per_task"] == "threads"
    for rule in rules() - {"all", "report_html"}:  # every submitted rule has a time limit
        assert "runtime" in sr.get(rule, {}) or "runtime" in cfg["default-resources"], rule
    # partition and account: the one documented place, left for the user
    text = SLURM.read_text()
    assert re.search(r"^\s*# slurm_partition:", text, re.M)
    assert re.search(r"^\s*# slurm_account:", text, re.M)


def test_kubernetes_profile():
    cfg = load(K8S)
    assert cfg["executor"] == "kubernetes"
    for rule in GPU_RULES:
        assert cfg["set-resources"][rule]["gpu_manufacturer"] == "'nvidia'", rule
    assert cfg["default-storage-provider"] and cfg["default-storage-prefix"]
    assert cfg["container-image"]


def plan(profile: Path, tmp_path: Path, env: dict[str, str] | None = None) -> str:
    cmd = [
        sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"),
        "--profile", str(profile), "--configfile", str(REPO / "tests" / "micro.yaml"),
        "--", "iter_002/eval.json",
    ]  # fmt: skip
    p = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return out


def needs(*modules: str):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {missing} (.[cluster])")


@needs("snakemake_executor_plugin_slurm")
def test_slurm_profile_plans_the_dag(tmp_path):
    out = plan(SLURM.parent, tmp_path)
    assert "rollout            4" in out and "eval               1" in out, out[-2000:]
    rollout = out[out.index("rule rollout:") :]
    assert "gpu=1" in rollout.split("Shell command")[0]


@needs("snakemake_executor_plugin_kubernetes", "snakemake_storage_plugin_fs")
def test_kubernetes_profile_plans_the_dag(tmp_path):
    # The profile as written but for its bucket: the fs provider on a local folder (what the
    # PersistentVolumeClaim variant in the profile uses) stands in for s3, and the credentials
    # it forwards to the pods are dummies. Nothing is submitted: -n.
    cfg = load(K8S)
    cfg["default-storage-provider"] = "fs"
    cfg["default-storage-prefix"] = str(tmp_path / "store")
    prof = tmp_path / "profile"
    prof.mkdir()
    (prof / "config.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "run").mkdir()
    env = {v: "dummy" for v in cfg.get("envvars", [])}
    out = plan(prof, tmp_path / "run", env)
    assert "rollout            4" in out and "eval               1" in out, out[-2000:]
    assert "gpu_manufacturer=nvidia" in out


# -- docker/Dockerfile installs what CI installs ------------------------------------------


def logical_lines(text: str) -> list[str]:
    """Shell/Dockerfile lines with continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", text)
    return [
        ln.split(" #")[0].strip() for ln in text.splitlines() if not ln.lstrip().startswith("#")
    ]


def commands(text: str) -> list[list[str]]:
    """Every simple command: lines split on && ; | and redirections dropped."""
    out = []
    for line in logical_lines(text):
        lex = shlex.shlex(re.sub(r"^RUN\s+", "", line), posix=True, punctuation_chars=";&|>")
        lex.whitespace_split = True
        cmd: list[str] = []
        tokens = iter(lex)
        for tok in tokens:
            if tok in {"&&", ";", "||", "|", "&"}:
                out.append(cmd)
                cmd = []
            elif tok in {">", ">>", "2>"}:
                next(tokens, None)  # the redirection's target
            else:
                cmd.append(tok)
        out.append(cmd)
    return [c for c in out if c]


def apt_packages(cmds: list[list[str]]) -> list[set[str]]:
    return [
        {a for a in c[c.index("install") + 1 :] if not a.startswith("-")}
        for c in cmds
        if "apt-get" in c and "install" in c
    ]


def pip_installs(cmds: list[list[str]]) -> list[list[str]]:
    return [[a for a in c[c.index("install") + 1 :] if a != "-q"] for c in cmds if c[:1] == ["pip"]]


def test_dockerfile_installs_what_ci_installs():
    ci = commands((REPO / ".ci" / "run").read_text())
    docker = commands((REPO / "docker" / "Dockerfile").read_text())
    (ci_apt,) = apt_packages(ci)
    assert ci_apt in apt_packages(docker), "the Dockerfile lacks CI's apt-get install line"
    ci_pip, docker_pip = pip_installs(ci), pip_installs(docker)
    torch = [p for p in ci_pip if any(a.startswith("torch==") for a in p)]
    assert torch and torch[0] in docker_pip, "a different torch pin"
    # the project from this checkout, editable, as CI (CI adds the [dev] extra for tests)
    ci_project = [p for p in ci_pip if p[:1] == ["-e"]]
    assert ci_project and ci_project[0][1].split("[")[0] == "."
    assert ["-e", "."] in docker_pip
    # the torch pin is installed before the project, as in CI
    assert docker_pip.index(torch[0]) < docker_pip.index(["-e", "."])
    assert any(c[:3] == ["python3", "-m", "venv"] for c in docker), "no venv"
