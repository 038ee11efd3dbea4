"""The operator's ClusterRole grants exactly what its rule comments say, and nothing wild.

Each rule in templates/rbac.yaml carries a header comment
    # <framework|application>: <apiGroup or core>/<resource>[,<resource>...] -> <verb>, ...
which is what a reviewer reads; these tests hold the rules to it, one rule per header.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

HEADER = re.compile(
    r"^\s*# (?P<kind>framework|application): (?P<group>[a-z0-9.-]+)/(?P<resources>[a-z/,]+)"
    r" -> (?P<verbs>[a-z, ]+)$"
)
READ_VERBS = {"get", "list", "watch"}
Grant = tuple[str, str, str]  # (apiGroup, resource, verb)


def parse_annotated_rules(role_text: str) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(header, rules below it until the next header) for a rendered ClusterRole's text."""
    body = role_text.split("\nrules:\n", 1)[1]
    blocks: list[tuple[dict[str, Any], list[str]]] = []
    for line in body.splitlines():
        match = HEADER.match(line)
        if match:
            blocks.append((_header(match), []))
        elif line.strip() and not line.lstrip().startswith("#"):
            if not blocks:
                raise AssertionError(f"rule line before any header comment: {line!r}")
            blocks[-1][1].append(line)
    return [(header, yaml.safe_load(textwrap.dedent("\n".join(lines)))) for header, lines in blocks]


def _header(match: re.Match[str]) -> dict[str, Any]:
    return {
        "kind": match["kind"],
        "apiGroups": ["" if match["group"] == "core" else match["group"]],
        "resources": match["resources"].split(","),
        "verbs": [verb.strip() for verb in match["verbs"].split(",")],
    }


def grants(rules: list[dict[str, Any]]) -> set[Grant]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_every_rule_sits_under_one_header_that_it_matches(chart) -> None:
    blocks = parse_annotated_rules(_role_text(chart))
    assert blocks, "no annotated rules found in templates/rbac.yaml"
    for header, rules in blocks:
        assert len(rules) == 1, f"header {header} covers {len(rules)} rules; give each its own"
        [rule] = rules
        assert rule == {k: header[k] for k in ("apiGroups", "resources", "verbs")}, (
            f"{header['kind']} rule {rule} differs from its comment {header}"
        )


def test_cluster_role_grants_exactly_the_commented_set(chart, find_object) -> None:
    role = find_object(chart.objects(), "ClusterRole", "pdd-operator")
    headers = [header for header, _ in parse_annotated_rules(_role_text(chart))]
    assert len(role["rules"]) == len(headers)
    assert grants(role["rules"]) == grants(headers)


def test_no_wildcards_anywhere(chart, find_object) -> None:
    role = find_object(chart.objects(), "ClusterRole", "pdd-operator")
    for rule in role["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key] and all("*" not in item for item in rule[key]), rule
        assert "resourceNames" not in rule or rule["resourceNames"]
        assert "nonResourceURLs" not in rule


def test_framework_rules_are_only_what_kopf_needs(chart) -> None:
    framework = {
        resource
        for header, _ in parse_annotated_rules(_role_text(chart))
        if header["kind"] == "framework"
        for resource in header["resources"]
    }
    assert framework == {
        "customresourcedefinitions", "namespaces", "events", "pdddeployments",
        "clusterkopfpeerings",  # the replicas' peering
    }  # fmt: skip


def test_cluster_scoped_and_borrowed_objects_are_only_read(chart, find_object) -> None:
    role = find_object(chart.objects(), "ClusterRole", "pdd-operator")
    for _, resource, verb in grants(role["rules"]):
        if resource in ("customresourcedefinitions", "namespaces"):
            assert verb in READ_VERBS, f"the operator must not {verb} {resource}"


@pytest.mark.parametrize(
    "drifted",
    [
        "  # application: apps/deployments -> get, create\n"
        "  - apiGroups: [apps]\n    resources: [deployments]\n    verbs: [get, create, delete]\n",
        "  - apiGroups: [apps]\n    resources: [deployments]\n    verbs: [get]\n",
    ],
    ids=["verbs-beyond-comment", "no-comment"],
)
def test_a_drifted_rule_is_caught(drifted: str) -> None:
    with pytest.raises(AssertionError):
        for header, [rule] in parse_annotated_rules(f"kind: ClusterRole\nrules:\n{drifted}"):
            assert rule == {k: header[k] for k in ("apiGroups", "resources", "verbs")}


def _role_text(chart) -> str:
    """The rendered ClusterRole alone (rbac.yaml also holds its binding)."""
    return chart.render()["templates/rbac.yaml"].split("\n---")[0]
