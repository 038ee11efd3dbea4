#!/usr/bin/env python3
"""Generate charts/pdd/README.md from the chart's values.yaml comments (helm-docs style).

    scripts/chart_readme.py            # rewrite charts/pdd/README.md
    scripts/chart_readme.py --check    # exit 1 if README.md is not what this generates

A ``# -- text`` comment (continued by the ``#`` lines right below it) documents the key
on the next line; a documented key whose value is a map is one row, its default the whole
map. Every value of values.yaml must be documented by its own key or a map above it: an
undocumented one fails the generation, naming it. The prose around the table comes from
charts/pdd/README.md.in (``{{ values }}``, ``{{ version }}``, ``{{ appVersion }}`` and
``{{ description }}`` are filled in). tests/charts/test_readme.py runs ``--check``'s
comparison, so a values.yaml change without a regenerated README fails the tests.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "pdd"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")
DOC_START = re.compile(r"^ *# -- ?(?P<text>.*)$")
DOC_MORE = re.compile(r"^ *# ?(?P<text>.*)$")


class UndocumentedValues(ValueError):
    """Keys of values.yaml that no ``# --`` comment covers."""


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    description: str


def documented_keys(text: str) -> dict[str, str]:
    """Dotted key path -> its ``# --`` description, in file order."""
    docs: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the maps enclosing this line
    pending: list[str] | None = None
    for line in text.splitlines():
        if not line.strip():
            pending = None
            continue
        start = DOC_START.match(line)
        if start:
            pending = [start["text"].strip()]
            continue
        if line.lstrip().startswith("#"):
            if pending is not None:
                more = DOC_MORE.match(line)
                pending.append(more["text"].strip() if more else "")
            continue
        match = KEY.match(line)
        if match is None:  # a list item or a continued scalar: not a key
            pending = None
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [match["key"]])
        if pending is not None:
            docs[path] = " ".join(part for part in pending if part)
        pending = None
        stack.append((indent, match["key"]))
    return docs


def leaves(values: Any, prefix: str = "") -> list[str]:
    """Every dotted path to a value that is not a non-empty map."""
    if not isinstance(values, dict) or not values:
        return [prefix]
    return [path for k, v in values.items() for path in leaves(v, f"{prefix}.{k}".lstrip("."))]


def lookup(values: dict[str, Any], path: str) -> Any:
    node: Any = values
    for part in path.split("."):
        node = node[part]
    return node


def type_name(value: Any) -> str:
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "string"),
                       (list, "list"), (dict, "object")):  # fmt: skip
        if isinstance(value, kind):
            return name
    return "string"  # null


def rows(text: str) -> list[Row]:
    """The table's rows; UndocumentedValues if any value is covered by no comment."""
    docs = documented_keys(text)
    values = yaml.safe_load(text) or {}
    missing = [
        leaf
        for leaf in leaves(values)
        if not any(leaf == key or leaf.startswith(f"{key}.") for key in docs)
    ]
    if missing:
        raise UndocumentedValues(
            "values.yaml keys without a `# --` comment (on the key or a map above it): "
            + ", ".join(missing)
        )
    out = []
    for key, description in docs.items():
        value = lookup(values, key)
        default = json.dumps(value, separators=(",", ":"), sort_keys=False)
        out.append(Row(key, type_name(value), default, description))
    return out


def table(text: str) -> str:
    lines = ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for row in rows(text):
        description = row.description.replace("<", "&lt;").replace(">", "&gt;")
        cells = [f"`{row.key}`", row.type, f"`{row.default}`", description]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def generate(chart: Path = CHART) -> str:
    """README.md's text for the chart at ``chart``."""
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    text = (chart / "README.md.in").read_text()
    fills = {
        "values": table((chart / "values.yaml").read_text()),
        "version": str(meta["version"]),
        "appVersion": str(meta["appVersion"]),
        "description": " ".join(str(meta["description"]).split()),
    }
    for name, value in fills.items():
        text = text.replace("{{ " + name + " }}", value)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a diff")
    args = parser.parse_args(argv)
    try:
        wanted = generate()
    except UndocumentedValues as exc:
        print(f"chart_readme: {exc}", file=sys.stderr)
        return 1
    readme = CHART / "README.md"
    if args.check:
        if not readme.exists() or readme.read_text() != wanted:
            print("chart_readme: charts/pdd/README.md is stale; run scripts/chart_readme.py",
                  file=sys.stderr)  # fmt: skip
            return 1
        return 0
    readme.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
