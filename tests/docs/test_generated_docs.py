"""Generated sections of docs/ match the code: a block between ``<!-- generated: NAME -->`` and
``<!-- end generated -->`` is what ``GENERATORS[NAME]()`` returns. The tests fail when
a page differs from its code; ``PDD_UPDATE_DOCS=1`` rewrites the pages instead:

    PDD_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/docs -n 0
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from pdd.common.config_document import EngineSettings
from pdd.common.settings import flag_table, settings_of, settings_table

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(
    r"(<!-- generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S
)


def _flags(module: str) -> Callable[[], str]:
    return lambda: flag_table(importlib.import_module(module).build_parser())


GENERATORS: dict[str, Callable[[], str]] = {
    "engine-settings": lambda: settings_table(settings_of(EngineSettings), "engine."),
    "flags-router": _flags("pdd.router.server"),
    "flags-worker": _flags("pdd.worker.server"),
    "flags-wan-link": _flags("pdd.wan.cli"),
    "flags-up": _flags("pdd.local.up"),
    "flags-operator": _flags("pdd.operator.main"),
}


def render(text: str) -> str:
    """``text`` with every generated block replaced by what its generator returns now."""

    def fill(m: re.Match[str]) -> str:
        return m.group(1) + GENERATORS[m.group("name")]() + m.group(4)

    return BLOCK.sub(fill, text)


def blocks(text: str) -> list[str]:
    return [m.group("name") for m in BLOCK.finditer(text)]


PAGES = sorted(p for p in (REPO / "docs").glob("*.md") if "<!-- generated:" in p.read_text())


def test_every_generator_has_its_block_in_a_page() -> None:
    used = {name for page in PAGES for name in blocks(page.read_text())}
    assert used == set(GENERATORS)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_page_matches_the_code(page) -> None:
    text = page.read_text()
    fresh = render(text)
    if os.environ.get("PDD_UPDATE_DOCS") == "1":
        page.write_text(fresh)
    assert fresh == text, f"{page.name} is stale: PDD_UPDATE_DOCS=1 pytest tests/docs -n 0"
