"""The WAN line's settings (``WanLine``): one model, from which every command that runs or
declares the line generates its flags, and from which ``pdd wan-link``'s argv is written."""

from __future__ import annotations

import argparse

import pytest

from pdd.common.settings import add_settings, flag_values, setting, settings_of
from pdd.common.wan_line import WanLine, add_line_flags, line_argv, parsed_line

pytestmark = pytest.mark.unit

FLAGS = ("--link-gbps", "--link-rtt-ms", "--link-jitter-ms", "--partition-grace-s")


def flags_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


def test_the_line_flags_are_named_as_the_commands_name_them() -> None:
    """A field's flag may be named apart from the field (``gbps`` is ``--link-gbps`` beside
    a command's other flags): the flag and its dest take that name, the model its own."""
    assert [s.flag for s in settings_of(WanLine)] == list(FLAGS)
    parser = argparse.ArgumentParser()
    add_line_flags(parser)
    args = parser.parse_args(["--link-gbps", "2.5", "--link-jitter-ms", "3"])
    assert args.link_gbps == 2.5 and not hasattr(args, "gbps")
    assert parsed_line(args, WanLine) == WanLine(gbps=2.5, jitter_ms=3.0)


def test_without_a_line_the_rate_is_required_and_the_rest_default_to_the_models(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_line_flags(parser)
    flags = flags_of(parser)
    assert flags["--link-gbps"].required and "(required)" in flags["--link-gbps"].help
    assert flags["--link-rtt-ms"].default == WanLine.model_fields["rtt_ms"].default == 0.0
    assert flags["--partition-grace-s"].default == 5.0
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "required: --link-gbps" in capsys.readouterr().err


def test_a_line_given_is_the_flags_defaults_and_only_picks_flags() -> None:
    line = WanLine(gbps=0.05, rtt_ms=30.0, jitter_ms=5.0)
    parser = argparse.ArgumentParser()
    add_line_flags(parser, line, only={"gbps", "rtt_ms", "jitter_ms"})
    flags = flags_of(parser)
    assert set(flags) == {"-h", "--help", *FLAGS[:3]}
    assert not flags["--link-gbps"].required
    assert flags["--link-gbps"].help.endswith("(default: 0.05)")
    args = parser.parse_args([])
    assert parsed_line(args, WanLine) == line


def test_the_emulators_argv_is_written_from_the_same_flags() -> None:
    """What a local stack passes ``pdd wan-link`` parses back into the same line."""
    line = WanLine(gbps=0.05, rtt_ms=30.0, jitter_ms=5.0, partition_grace_s=1.0)
    parser = argparse.ArgumentParser()
    add_line_flags(parser)
    assert parsed_line(parser.parse_args(line_argv(line)), WanLine) == line


def test_a_flag_named_apart_from_its_field_keeps_its_field_in_the_table() -> None:
    """``only`` and ``flag_values`` speak field names; argparse the flag's."""

    class Model(WanLine):
        extra: int = setting(3, "an extra", flag="more_extra")

    table = settings_of(Model)
    parser = argparse.ArgumentParser()
    add_settings(parser, table, only={"extra"})
    assert parser.parse_args(["--more-extra", "4"]).more_extra == 4
    assert flag_values(table, parser.parse_args([])) == {"extra": 3}
