"""The config reference, configs/README.md, generated from configs/schema.yaml.

One table per section, one row per key path: its type and range (from the schema), its value
in configs/default.yaml, the other configs/*.yaml files that set it, and the schema's
`description`. The hand-written part of configs/README.md above MARKER is kept; everything
below it is rewritten. tests/test_config_reference.py fails when the file is stale.

    python scripts/config_reference.py           # rewrite configs/README.md
    python scripts/config_reference.py --check   # exit 1 if configs/README.md is stale
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
README = CONFIGS / "README.md"
MARKER = "<!-- Generated below by scripts/config_reference.py from schema.yaml: do not edit. -->"
LONG = 28  # a value longer than this is shown in the "set in" column by file name only


def scalar(v: Any) -> str:
    """A value as YAML would write it inline: null, true, 1e-5, [a, b]."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}".replace("e-0", "e-").replace("e+0", "e+")
    if isinstance(v, list):
        return "[" + ", ".join(scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {scalar(x)}" for k, x in v.items()) + "}"
    return str(v)


def resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The node with its $ref's definition merged under its own keys."""
    if "$ref" not in node:
        return node
    base = defs[node["$ref"].rsplit("/", 1)[-1]]
    return {**base, **{k: v for k, v in node.items() if k != "$ref"}}


def bounds(node: dict[str, Any]) -> str:
    parts = []
    for key, sign in (
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
    ):
        if key in node:
            parts.append(f"{sign} {scalar(node[key])}")
    return ", ".join(parts)


def type_of(node: dict[str, Any], defs: dict[str, Any]) -> str:
    """The schema's constraint in words: `integer ≥ 1`, `egl | osmesa`, `list of ...`."""
    node = resolve(node, defs)
    if "const" in node:
        return f"{scalar(node['const'])} only"
    if "enum" in node:
        return " | ".join(scalar(v) for v in node["enum"])
    types = node.get("type", "any")
    types = types if isinstance(types, list) else [types]
    words = []
    for t in types:
        if t == "array":
            item = type_of(node.get("items", {}), defs)
            extra = ", unique" if node.get("uniqueItems") else ""
            extra += f", ≥ {node['minItems']} item(s)" if "minItems" in node else ""
            words.append(f"list of ({item}){extra}")
        elif t in ("integer", "number"):
            words.append(" ".join(filter(None, [t, bounds(node)])))
        else:
            words.append(str(t))
    return " or ".join(words)


def leaves(
    props: dict[str, Any], defs: dict[str, Any], prefix: str = ""
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted key path, schema node) for every key, objects with a description included."""
    for name, node in props.items():
        path = prefix + name
        node = resolve(node, defs)
        if "properties" in node:
            if node.get("description"):
                yield path, node
            yield from leaves(node["properties"], defs, path + ".")
        else:
            yield path, node


def lookup(cfg: dict[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def cell(text: str) -> str:
    """Text safe in a Markdown table cell."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("\n", " ")


def table(
    rows: list[tuple[str, dict[str, Any]]],
    defs: dict[str, Any],
    default: dict[str, Any],
    others: dict[str, dict[str, Any]],
) -> list[str]:
    out = ["| key | type | default | set in | meaning |", "| --- | --- | --- | --- | --- |"]
    for path, node in rows:
        if "properties" in node:
            kind, value = "section", "—"
        else:
            found, v = lookup(default, path)
            kind, value = type_of(node, defs), f"`{scalar(v)}`" if found else "—"
        sets = []
        for name, cfg in others.items():
            found, v = lookup(cfg, path)
            if found and "properties" not in node:
                shown = scalar(v)
                sets.append(f"{name}: `{shown}`" if len(shown) <= LONG else name)
        out.append(
            f"| `{path}` | {cell(kind)} | {cell(value)} | {cell(', '.join(sets))} "
            f"| {cell(node.get('description', ''))} |"
        )
    return out


def generated() -> str:
    """The part of configs/README.md below MARKER."""
    schema = yaml.safe_load((CONFIGS / "schema.yaml").read_text())
    defs = schema.get("$defs", {})
    default = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    others = {
        p.stem: yaml.safe_load(p.read_text()) or {}
        for p in sorted(CONFIGS.glob("*.yaml"))
        if p.stem not in ("default", "schema")
    }
    props = schema["properties"]
    top = [(k, v) for k, v in props.items() if "properties" not in resolve(v, defs)]
    lines = ["", "## Top level", "", *table(top, defs, default, others)]
    for name, node in props.items():
        node = resolve(node, defs)
        if "properties" in node:
            rows = list(leaves(node["properties"], defs, name + "."))
            lines += ["", f"## `{name}`", ""]
            if node.get("description"):
                lines += [node["description"], ""]
            lines += table(rows, defs, default, others)
    return "\n".join(lines) + "\n"


def undescribed() -> list[str]:
    """Key paths whose schema node has no description."""
    schema = yaml.safe_load((CONFIGS / "schema.yaml").read_text())
    defs = schema.get("$defs", {})
    return [
        path
        for path, node in leaves(schema["properties"], defs)
        if "properties" not in node and not node.get("description")
    ]


def render(current: str) -> str:
    """configs/README.md with its generated part replaced (the hand-written part kept)."""
    head = current.split(MARKER, 1)[0].rstrip("\n")
    return f"{head}\n\n{MARKER}\n{generated()}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if configs/README.md is stale")
    args = p.parse_args()
    current = README.read_text()
    want = render(current)
    if args.check:
        if current != want:
            print(f"{README} is stale: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(want)
    for path in undescribed():
        print(f"no description in configs/schema.yaml: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
