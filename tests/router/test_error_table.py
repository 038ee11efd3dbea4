"""docs/errors.md names every error class the router raises, with the status, OpenAI
``type`` and metric ``cause`` the class really has, so the table cannot drift."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import pdd.router
from pdd.router.errors import RouterError

pytestmark = pytest.mark.unit

TABLE = Path(__file__).parents[2] / "docs" / "errors.md"
#: A table row about a class: | `Name` | status | `type` | retryable | `cause` | when |
ROW = re.compile(r"^\| `(\w+Error)` \| (\d+) \| `(\w+)` \| (yes|no)[^|]* \| `(\w+)` \|")


def error_classes() -> dict[str, type[RouterError]]:
    """Every subclass of RouterError in any module of pdd.router (all imported first)."""
    for module in pkgutil.walk_packages(pdd.router.__path__, "pdd.router."):
        importlib.import_module(module.name)
    found: dict[str, type[RouterError]] = {}
    todo = list(RouterError.__subclasses__())
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo += cls.__subclasses__()
    return found


def table_rows() -> dict[str, tuple[int, str, bool, str]]:
    rows = {}
    for line in TABLE.read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, status, type_, retryable, cause = match.groups()
            rows[name] = (int(status), type_, retryable == "yes", cause)
    return rows


def test_the_table_lists_every_error_class_as_it_is() -> None:
    classes, rows = error_classes(), table_rows()
    assert sorted(rows) == sorted(classes)
    for name, cls in classes.items():
        retryable = cls.status in (429, 502, 503)  # capacity, a worker, readiness
        assert rows[name] == (cls.status, cls.type, retryable, cls.cause), name


def test_router_md_links_the_table() -> None:
    router_md = TABLE.with_name("router.md").read_text()
    assert "(errors.md)" in router_md
