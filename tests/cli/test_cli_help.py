"""Every command's ``--help``: every flag has help text and shows its default, the
log level is case-insensitive with its choices listed, and commands list their verbs."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

import pytest

from pdd.cli import SUBCOMMANDS
from pdd.common.settings import HelpFormatter

pytestmark = pytest.mark.unit

#: Every parser a user meets: each command's, and the operator's render verb.
PARSERS: dict[str, str] = {
    **{name: module for name, (module, _) in SUBCOMMANDS.items()},
    "operator render": "pdd.operator.render",
}
#: Commands that run a server (their logs are what an operator reads).
SERVERS = ("router", "worker", "wan-link", "operator")


def build(name: str) -> argparse.ArgumentParser:
    module = importlib.import_module(PARSERS[name])
    factory: Callable[[], argparse.ArgumentParser] = (
        getattr(module, "build_parser", None) or module._parser
    )
    return factory()


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._VersionAction)
        and not isinstance(a, argparse._SubParsersAction)
        and a.help != argparse.SUPPRESS
    ]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_flag_has_help_and_shows_its_default(name: str) -> None:
    parser = build(name)
    assert parser.formatter_class is HelpFormatter or issubclass(
        parser.formatter_class, HelpFormatter
    )
    formatter = parser._get_formatter()
    for action in flags(parser):
        assert action.help, f"pdd {name} {action.option_strings or action.dest}: no help text"
        shown = formatter._expand_help(action)
        if action.option_strings and action.default not in (None, False, []):
            assert "default" in shown, f"pdd {name} {action.option_strings}: default not shown"
    assert "``" not in (parser.description or "")


def test_operator_help_lists_render() -> None:
    text = build("operator").format_help()
    assert "render" in text


@pytest.mark.parametrize("name", SERVERS)
def test_log_level_takes_any_case_and_lists_the_choices(name: str) -> None:
    parser = build(name)
    (action,) = [a for a in parser._actions if "--log-level" in a.option_strings]
    assert "debug" in (action.metavar or "") and "critical" in (action.metavar or "")
    assert action.type is not None
    assert action.type("debug") == action.type("DEBUG") == "DEBUG"
    with pytest.raises(argparse.ArgumentTypeError):
        action.type("loud")
    (fmt,) = [a for a in parser._actions if "--log-format" in a.option_strings]
    assert tuple(fmt.choices or ()) == ("text", "json")
