"""``pdd.testing.source_tree.parse`` keeps ``ast.parse`` off the calling thread (the
workaround for CPython 3.11.7's "AST constructor recursion depth mismatch" under
pytest-xdist, see its docstring) on one thread for every file, not one new thread per file:
a tree read parses hundreds of files."""

from __future__ import annotations

import ast
import threading
from typing import Any

import pytest

from pdd.testing import source_tree

pytestmark = pytest.mark.unit


def test_every_parse_runs_on_one_thread_that_is_not_the_callers(monkeypatch) -> None:
    threads: list[threading.Thread] = []
    real_parse = ast.parse

    def recording_parse(source: str, *args: Any, **kwargs: Any) -> ast.Module:
        if source.startswith("x = "):  # pytest parses too, to explain a failed assert
            threads.append(threading.current_thread())
        return real_parse(source, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", recording_parse)
    trees = [source_tree.parse(f"x = {n}\n") for n in range(3)]
    assert [ast.unparse(tree) for tree in trees] == ["x = 0", "x = 1", "x = 2"]
    assert len(threads) == 3 and len(set(threads)) == 1
    assert threads[0] is not threading.current_thread()


def test_a_syntax_error_reaches_the_caller() -> None:
    with pytest.raises(SyntaxError):
        source_tree.parse("def (:\n")
