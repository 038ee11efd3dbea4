"""docs/architecture.md cites only what exists: every module path, class, member,
function and repository path it names in backticks is in the tree
(``pdd.testing.source_tree.missing_citations`` says what counts as a citation). A
rename in the code that the map does not follow fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdd.testing.source_tree import missing_citations, read_tree

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
MAP = REPO / "docs" / "architecture.md"


def test_the_architecture_map_cites_only_what_exists() -> None:
    text = MAP.read_text()
    assert "`pdd.router.dispatcher.Dispatcher.attempt`" in text  # it does cite code
    assert missing_citations(read_tree(REPO), text) == []


def test_a_renamed_module_name_or_member_is_reported(tmp_path: Path) -> None:
    """A document naming this repository's code: what exists passes, and each kind of
    citation is reported once it names something that is not there (as after a rename)."""
    doc = tmp_path / "map.md"
    doc.write_text(
        "Recovery asks `pdd.router.dispatcher.Dispatcher.attempt`, which calls `decide()`\n"
        "with a `LinkView`; the benchmarks are in `bench/pdd/bench/`.\n"
        "Renamed: `pdd.router.dispatch`, `pdd.router.dispatcher.Dispatcher.try_again`,\n"
        "`pdd.router.policy.decide_pipeline`, `LinkViewOf`, `Dispatcher.reroute`,\n"
        "`decide_again()` and `router/pdd/router/dispatch.py`. Not code: `pdd up`,\n"
        "`--max-tokens`, `/v1/chat/completions`, `P-RLD-MD`.\n"
    )
    assert missing_citations(read_tree(REPO), doc.read_text()) == [
        "pdd.router.dispatch",
        "pdd.router.dispatcher.Dispatcher.try_again",
        "pdd.router.policy.decide_pipeline",
        "LinkViewOf",
        "Dispatcher.reroute",
        "decide_again()",
        "router/pdd/router/dispatch.py",
    ]


def test_renaming_a_cited_method_in_the_code_fails_the_check(tmp_path: Path) -> None:
    """The same document against a tree before and after its method is renamed."""
    (tmp_path / "setup.py").write_text('COMPONENT_ROOTS = ("worker",)\n')
    engine = tmp_path / "worker" / "pdd" / "worker" / "engine.py"
    engine.parent.mkdir(parents=True)
    engine.write_text("class Engine:\n    def step(self):\n        pass\n")
    doc = "`pdd.worker.engine.Engine.step` is the story; `Engine.step` reads it in 7 lines."
    assert missing_citations(read_tree(tmp_path), doc) == []
    engine.write_text("class Engine:\n    def run_step(self):\n        pass\n")
    assert missing_citations(read_tree(tmp_path), doc) == [
        "pdd.worker.engine.Engine.step",
        "Engine.step",
    ]


#: What adding a routing rule takes (issue 57): the rule, the inputs its facts read, the
#: policy's docstring, a decision test, a simulator scenario and the generated docs table.
ROUTING_RULE_FILES = (
    "router/pdd/router/policy_rules.py",
    "router/pdd/router/policy_inputs.py",
    "router/pdd/router/policy.py",
    "tests/router/test_policy_rules.py",
    "tests/simulator/test_lifecycle.py",
    "tests/docs/test_generated_docs.py",
    "docs/router.md",
)


def section(text: str, title: str) -> str:
    """The text of the page's ``## title`` section, up to the next section."""
    _, found, rest = text.partition(f"\n## {title}\n")
    assert found, f"docs/architecture.md has no section {title!r}"
    return re.split(r"^#{1,2} ", rest, maxsplit=1, flags=re.MULTILINE)[0]


def test_the_routing_rule_recipe_names_every_file_a_rule_takes() -> None:
    """The page names its files as repository paths, so the check above proves each exists."""
    recipe = section(MAP.read_text(), "How to add a routing rule")
    assert [f for f in ROUTING_RULE_FILES if f"`{f}`" not in recipe] == []
