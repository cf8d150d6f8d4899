"""Configs: YAML files deep-merged onto configs/default.yaml, validated against configs/schema.yaml.

A wrong key, type or range stops everything before any work, with the key's dotted path:

    ConfigError: actor.lr: -1 is less than or equal to the minimum of 0
"""

from __future__ import annotations

import copy
import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar, get_args, get_type_hints

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"
SCHEMA = CONFIG_DIR / "schema.yaml"
RUN_CONFIG = Path(".wamrl") / "config.yaml"  # the resolved config a run's stages read


class ConfigError(ValueError):
    """A config that does not match the schema; the message names the key."""


class _Loader(yaml.SafeLoader):
    """YAML 1.1 (PyYAML) reads `1e-5` (no dot) as a string; YAML 1.2, JSON and every user
    read it as a float. Every config value (files, --set) is read with this loader."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader: no arbitrary Python objects


def read_yaml(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def expand_dotted(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"actor.lr": 1e-4} -> {"actor": {"lr": 1e-4}} (Snakemake's --config takes flat keys)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = str(key).split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {p} is both a value and a section")
        if isinstance(value, Mapping):
            value = expand_dotted(value)
            if isinstance(node.get(leaf), dict):
                value = deep_merge(node[leaf], value)
        node[leaf] = value
    return out


def _scalar(text: str) -> Any:
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text.lower(), text)


def coerce_strings(obj: Any) -> Any:
    """Snakemake's --config leaves nested values as strings ("-1", "1e-4"): type them."""
    if isinstance(obj, Mapping):
        return {k: coerce_strings(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [coerce_strings(v) for v in obj]
    return _scalar(obj) if isinstance(obj, str) else obj


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """["actor.lr=1e-4", "eval.suites=[libero_10]"] -> nested dict (values parsed as YAML)."""
    flat: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        flat[key.strip()] = load_yaml(raw)
    return expand_dotted(flat)


def _schema() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA.read_text())


def validate(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Raise ConfigError naming every offending key; return the config unchanged."""
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = []
        for e in errors:
            where = ".".join(map(str, e.absolute_path)) or "(top level)"
            if e.validator == "additionalProperties":
                extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
                known = ", ".join(sorted(e.schema.get("properties", {})))
                for k in extra:
                    key = f"{where}.{k}" if e.absolute_path else k
                    lines.append(f"{key}: unknown key (known here: {known})")
            else:
                lines.append(f"{where}: {e.message}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines))
    _check_consistency(cfg)
    return dict(cfg)


def _check_consistency(cfg: Mapping[str, Any]) -> None:
    """Cross-key rules a schema cannot say."""
    r = cfg["rollout"]
    if r["groups"] < r["workers"]:
        raise ConfigError(
            f"rollout.groups ({r['groups']}) < rollout.workers ({r['workers']}): "
            "every shard needs at least one group"
        )
    if cfg["policy"]["backend"] == "fastwam" and "fastwam" not in cfg["policy"]:
        raise ConfigError(
            "policy.fastwam: required with policy.backend fastwam (configs/fastwam.yaml sets it)"
        )
    if cfg["sampler"]["compile"] and not cfg["sampler"]["cuda_graphs"]:
        # compile only changes what the CUDA graphs record: without them it would be ignored
        raise ConfigError("sampler.compile: needs sampler.cuda_graphs true (it compiles the "
                          "layers the graphs record)")  # fmt: skip
    kstar_max, K = cfg["sampler"]["kstar_max"], cfg["sampler"]["K"]
    if kstar_max is not None and kstar_max > K - 1:
        raise ConfigError(f"sampler.kstar_max: {kstar_max} exceeds K - 1 = {K - 1} (sampler.K)")
    low = [f"{k}.amp" for k in ("sampler", "actor") if cfg[k]["amp"] is not None]
    fw = cfg["policy"].get("fastwam") or {}
    if cfg["policy"]["backend"] == "fastwam" and fw.get("dtype", "float32") != "float32":
        low.append("policy.fastwam.dtype")
    if low and cfg["actor"]["logp_old"] == "rollout":
        # Half precision moves log pi by ~0.1-0.3 (bench_learner), and with the batch it was
        # computed in: far past the 1e-3 check. The rollout's value cannot be the ratio's
        # denominator; the learner must recompute its own.
        raise ConfigError(
            f"{' and '.join(low)}: half precision needs actor.logp_old: recompute "
            "(its log pi cannot reproduce the rollout's to actor.logp_check_tol)"
        )
    _check_tasks(cfg, "rollout")
    _check_tasks(cfg, "eval")
    _check_tasks(cfg, "demos")
    if (cfg["world_model"]["window_frames"] - 1) % 4:
        raise ConfigError(
            "world_model.window_frames: must be 4k+1 (video frames are 4 env steps apart)"
        )


def _check_tasks(cfg: Mapping[str, Any], section: str) -> None:
    """<section>.tasks must pick tasks of <section>.suites: otherwise the stage that reads
    them fails only when it runs, after the rest of the iteration."""
    from wamrl.envs.tasks import tasks_in_suites

    picked = cfg[section]["tasks"]
    if picked is None:
        return
    suites = cfg[section]["suites"]
    inside = {t.index for t in tasks_in_suites(suites)}
    outside = sorted(set(picked) - inside)
    if outside:
        raise ConfigError(
            f"{section}.tasks: {outside} are not tasks of {section}.suites {suites} "
            f"(those are {min(inside)}..{max(inside)} in table order; null = all of them)"
        )


def load_config(
    files: Iterable[Path] = (), overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """default.yaml, then each file in order, then overrides; validated."""
    cfg = read_yaml(DEFAULT_CONFIG)
    for f in files:
        cfg = deep_merge(cfg, expand_dotted(read_yaml(Path(f))))
    if overrides:
        cfg = deep_merge(cfg, expand_dotted(overrides))
    return validate(cfg)


def resolve_path(path: str | Path) -> Path:
    """Config paths are relative to the repository (where configs/ and data/ live)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def dump(cfg: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(cfg), sort_keys=False)


# --------------------------------------------------------------------------- a run keeps its config

# What an artifact's content depends on, as dotted key prefixes: a stage that reads the
# artifact under other values for these would mix two configs in one result. Knobs that
# change only speed or placement (workers per env, batch sizes of queries, compilation, GL
# backend, caches) are left out, so that a stage may still be rerun with them changed.
MADE_UNDER: dict[str, tuple[str, ...]] = {
    "rollout": (
        "seed",
        "policy.backend",
        "policy.base_checkpoint",
        "rollout.workers",
        "rollout.groups",
        "rollout.group_size",
        "rollout.video_sft_share",
        "rollout.oversample_temperature",
        "rollout.suites",
        "sampler.K",
        "sampler.noise_a",
        "sampler.shift",
        "sampler.amp",
        "sampler.kstar_max",
        "env.render_size",
        "env.settle_steps",
        "env.replan_steps",
        "env.max_macro_steps",
        "env.msaa",
    ),
    # All of reward/ but imagine_batch (how many steps share one device call).
    "reward": tuple(
        f"reward.{k}"
        for k in (
            "beta",
            "gamma",
            "gamma_libero_10",
            "rec_clip",
            "world_model",
            "imagine_steps",
            "filter",
            "zero_spread_eps",
        )
    ),
}
# Keys no artifact depends on (they pick the Snakemake targets): a resumed run may change them.
FREE_KEYS = ("pipeline",)
_ABSENT = "(absent)"


def flatten(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(f"{p}.") for p in prefixes)


def config_diff(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    keys: Iterable[str] | None = None,
    ignore: Iterable[str] = (),
) -> list[str]:
    """`key: old -> new` for every differing leaf (only under the dotted prefixes `keys`,
    none under those in `ignore`)."""
    a, b = flatten(old), flatten(new)
    wanted = tuple(keys) if keys is not None else None
    skip = tuple(ignore)
    lines = []
    for k in sorted(set(a) | set(b)):
        if (wanted is not None and not _under(k, wanted)) or _under(k, skip):
            continue
        va, vb = a.get(k, _ABSENT), b.get(k, _ABSENT)
        if va != vb:
            lines.append(f"{k}: {va!r} -> {vb!r}")
    return lines


def check_made_under(cfg: Mapping[str, Any], recorded: Any, artifact: str, source: Path) -> None:
    """Raise ConfigError (naming `source` and each differing key) unless the config that
    `source` recorded agrees with `cfg` on what an `artifact` depends on (MADE_UNDER)."""
    if not isinstance(recorded, Mapping):
        raise ConfigError(
            f"{source}: records no config, so it cannot be checked against this run's "
            f"(written by an older wamrl? rerun the stage that makes it)"
        )
    diff = config_diff(recorded, cfg, MADE_UNDER[artifact])
    if diff:
        raise ConfigError(
            f"{source} was made under another config than this stage runs with "
            "(recorded -> now):\n  " + "\n  ".join(diff) + "\nRerun the stage that makes it "
            "under this config, or run this stage under the recorded one."
        )


# --------------------------------------------------------------------------- typed sections

# Stage code reads a config section as a frozen dataclass rather than by string keys: a
# misspelt key is an AttributeError at the first test, and numbers are numbers even where
# a config arrived unvalidated (a YAML 1.1 `1e-5` is a string; section() converts it).

S = TypeVar("S")


@dataclass(frozen=True)
class RolloutSection:
    SECTION: ClassVar[str] = "rollout"
    workers: int
    envs_per_worker: int
    groups: int
    group_size: int
    video_sft_share: float
    oversample_temperature: float
    suites: list[str]
    tasks: list[int] | None
    fixed_batch: bool


@dataclass(frozen=True)
class RewardSection:
    SECTION: ClassVar[str] = "reward"
    beta: float
    gamma: float
    gamma_libero_10: float
    rec_clip: float
    world_model: str  # live | frozen
    imagine_steps: int
    imagine_batch: int
    adv_scale: str  # step | episode
    filter: str
    zero_spread_eps: float


@dataclass(frozen=True)
class ActorSection:
    SECTION: ClassVar[str] = "actor"
    epochs: int
    minibatch: int | None
    micro_batch: int | None
    lr: float
    beta1: float
    clip_low: float
    clip_high: float
    target_kl: float | None
    max_kl: float | None
    anneal: str  # none | linear
    ref_kl: float
    step_weight: str  # none | inv_sensitivity
    grad_clip: float
    logp_check_tol: float
    amp: str | None
    logp_old: str  # rollout | recompute
    devices: int


@dataclass(frozen=True)
class WorldModelSection:
    SECTION: ClassVar[str] = "world_model"
    lora_rank: int
    lr: float
    epochs: int
    batch: int
    windows_per_episode: int
    window_frames: int
    kl_weight: float
    ema: float


@dataclass(frozen=True)
class EnvSection:
    SECTION: ClassVar[str] = "env"
    mujoco_gl: str
    render_size: int
    settle_steps: int
    replan_steps: int
    max_macro_steps: int | None
    msaa: bool
    model_cache: str | None


@dataclass(frozen=True)
class TinyPolicySection:
    """policy.tiny: the built-in backend's dims."""

    video_dim: int
    action_dim: int
    layers: int
    heads: int
    head_dim: int
    latent_channels: int
    ffn_mult: int
    text_max_len: int


@dataclass(frozen=True)
class PolicySection:
    SECTION: ClassVar[str] = "policy"
    backend: str  # tiny | fastwam
    base_checkpoint: str | None  # a policy directory | sft | None (fresh random model)
    stats: str
    tiny: TinyPolicySection
    # configs/fastwam.yaml's section, as the fastwam backend reads it; the one key the schema
    # leaves optional (validate() requires it with backend fastwam)
    fastwam: dict[str, Any] | None = None


@dataclass(frozen=True)
class SamplerSection:
    SECTION: ClassVar[str] = "sampler"
    K: int
    noise_a: float
    shift: float
    kstar_max: int | None
    cuda_graphs: bool
    amp: str | None
    max_batch: int | None
    compile: bool


@dataclass(frozen=True)
class EvalSection:
    SECTION: ClassVar[str] = "eval"
    every: int
    protocol: str  # wamrl | official
    episodes_per_task: int
    K: int
    seed: int
    max_macro_steps: int | None
    envs: int
    lockstep: bool
    videos: int
    suites: list[str]
    tasks: list[int] | None


@dataclass(frozen=True)
class DemosSection:
    SECTION: ClassVar[str] = "demos"
    workers: int
    first_init_state: int
    init_states: int
    action_noise: float
    suites: list[str]
    tasks: list[int] | None


@dataclass(frozen=True)
class SftSection:
    SECTION: ClassVar[str] = "sft"
    steps: int
    time_budget_s: float | None
    batch: int
    video_batch: int
    video_frames: int
    video_weight: float
    augment_shift: int
    lr: float
    weight_decay: float
    warmup: int
    grad_clip: float
    log_every: int
    save_every: int | None


def _convert(hint: Any, value: Any, where: str) -> Any:
    """int and float fields (optional ones too) as numbers, a nested section's mapping as its
    dataclass; everything else as given."""
    if value is None:
        return None
    if is_dataclass(hint):
        return _build(hint, value, where)  # type: ignore[arg-type]
    kinds = set(get_args(hint)) if isinstance(hint, types.UnionType) else {hint}
    for kind in (int, float):
        if kind in kinds and not isinstance(value, bool):
            return kind(value)
    return value


def _build(cls: type[S], raw: Mapping[str, Any], where: str) -> S:
    hints = get_type_hints(cls)
    every = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    # a field with a default is a key the schema leaves optional
    required = {
        f.name
        for f in fields(cls)  # type: ignore[arg-type]
        if f.default is MISSING and f.default_factory is MISSING
    }
    have = set(raw)
    if not required <= have <= every:
        raise ConfigError(
            f"{where}: keys {sorted((have - every) | (required - have))} differ from the typed "
            "section's (configs/schema.yaml and wamrl/config.py must agree)"
        )
    return cls(**{k: _convert(hints[k], raw[k], f"{where}.{k}") for k in have})


def section(cfg: Mapping[str, Any], cls: type[S]) -> S:
    """cfg[cls.SECTION] as the frozen dataclass `cls`; its fields are the schema's keys (a
    nested section, e.g. policy.tiny, as its own dataclass)."""
    name = cls.SECTION  # type: ignore[attr-defined]
    return _build(cls, cfg[name], name)
