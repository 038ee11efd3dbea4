"""The chart's README is generated from values.yaml's comments, and documents every value."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def generator() -> ModuleType:
    """scripts/chart_readme.py, loaded as a module (scripts/ is not a package)."""
    path = REPO / "scripts" / "chart_readme.py"
    spec = importlib.util.spec_from_file_location("chart_readme", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chart_readme", module)
    spec.loader.exec_module(module)
    return module


def test_readme_is_the_generated_one(chart) -> None:
    assert (chart.path / "README.md").read_text() == generator().generate(chart.path), (
        "charts/pdd/README.md is stale: run scripts/chart_readme.py"
    )


def test_every_value_has_a_row_with_its_default(chart) -> None:
    text = (chart.path / "values.yaml").read_text()
    rows = {row.key: row for row in generator().rows(text)}
    values = yaml.safe_load(text)
    for leaf in generator().leaves(values):
        assert any(leaf == key or leaf.startswith(f"{key}.") for key in rows), leaf
    assert rows["operator.image.repository"].default == '"ghcr.io/pdd-project/pdd-operator"'
    assert rows["redis.resources"].type == "object"
    assert rows["replicaCount"].description.startswith("Operator replicas.")


def test_an_undocumented_value_fails_the_generation_naming_it() -> None:
    text = (
        "# -- Documented.\na: 1\nb:\n  c: 2\n  # -- Documented too,\n  # over two lines.\n  d: 3\n"
    )
    module = generator()
    with pytest.raises(module.UndocumentedValues, match=r"b\.c"):
        module.rows(text)
    rows = module.rows(text.replace("b:\n", "# -- The whole map.\nb:\n"))
    assert [(r.key, r.description) for r in rows] == [
        ("a", "Documented."),
        ("b", "The whole map."),
        ("b.d", "Documented too, over two lines."),
    ]
