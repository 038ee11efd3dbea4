"""CEL rules: declared once, beside the fields they constrain, and checked twice from that
one declaration.

A spec model lists its rules in ``json_schema_extra`` (``validations(Rule(...))``); the CRD
generator (``pdd.operator.crd``) writes them into the schema's ``x-kubernetes-validations``,
where the API server runs them at admission, and the operator runs the very same rules, read
back from that generated schema (``failures``), on the spec it is handed: it cannot trust
that admission ran (an emulator, a CR stored before a rule existed, an old CRD).

A message may name its place with ``{path}`` (``planner.relay``), filled in where the
generator places the rule, so that one model used in several places says which one failed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import celpy

#: Where a rule's message names the place it sits (``relay``, ``planner.mainDecode``).
PATH = "{path}"


@dataclass(frozen=True)
class Rule:
    """One ``x-kubernetes-validations`` entry: ``rule`` must hold for ``self``, the value of
    the object it is declared on (after the API server's defaulting)."""

    rule: str
    message: str
    #: A CEL string expression that wins over ``message`` (values in the message).
    message_expression: str | None = None

    def schema(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message}
        if self.message_expression is not None:
            entry["messageExpression"] = self.message_expression
        return entry


def validations(*rules: Rule) -> dict[str, Any]:
    """A model's ``json_schema_extra`` carrying ``rules``."""
    return {"x-kubernetes-validations": [rule.schema() for rule in rules]}


def placed(entries: list[dict[str, str]], path: str) -> list[dict[str, str]]:
    """``entries`` with ``{path}`` in their messages replaced by where they sit."""
    return [{key: text.replace(PATH, path) for key, text in entry.items()} for entry in entries]


def failures(schema: dict[str, Any], value: Any) -> list[str]:
    """The message of every ``x-kubernetes-validations`` rule in ``schema`` that ``value``
    breaks, walking the properties ``value`` has, outermost first (the API server's order)."""
    found = []
    rules = schema.get("x-kubernetes-validations", [])
    if rules:
        activation = {"self": celpy.json_to_cel(value)}
        found += [_message(entry, activation) for entry in rules
                  if not _holds(entry["rule"], activation)]  # fmt: skip
    if isinstance(value, dict):
        for key, prop in schema.get("properties", {}).items():
            if key in value:
                found += failures(prop, value[key])
    if isinstance(value, list) and "items" in schema:
        for item in value:
            found += failures(schema["items"], item)
    return found


def _holds(rule: str, activation: dict[str, Any]) -> bool:
    """Whether the rule holds; an evaluation error fails it, as the API server's does."""
    try:
        result = _program(rule).evaluate(activation)
    except celpy.CELEvalError:
        return False
    return isinstance(result, bool | celpy.celtypes.BoolType) and bool(result)


def _message(entry: dict[str, str], activation: dict[str, Any]) -> str:
    """The rule's messageExpression's value where it has one (and it evaluates), else its
    message."""
    expression = entry.get("messageExpression")
    if expression is None:
        return entry["message"]
    try:
        message = _program(expression).evaluate(activation)
    except celpy.CELEvalError:
        return entry["message"]
    return message if isinstance(message, str) else entry["message"]


@functools.cache
def _program(expression: str) -> Any:
    """A compiled CEL program (compiling is the slow part; the rules are few and fixed)."""
    environment = celpy.Environment()
    return environment.program(environment.compile(expression))
