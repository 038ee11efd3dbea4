"""The WAN line between the datacenters: its settings, declared once.

``WanLine`` is what the emulator runs (``pdd wan-link``), what a local stack starts it
with (``pdd up``, ``pdd bench``: ``pdd.local.cluster.LinkSpec`` is a ``WanLine``), and
what the router declares (``RouterConfig.link_gbps`` and ``link_rtt_ms`` are its fields,
read from the PDDDeployment's ``spec.wan.declaredGbps`` and ``rttMs``, which ``pdd up``
writes from its line). Each command's flags are generated from it (``add_line_flags``),
and the emulator's command line is written from the same table (``line_argv``), so a
line setting has one name, help and type from the flag to the emulator.

The bounds a line is built within (rates from 1 kbit/s to 10 Tbit/s, delays up to a
minute) are the emulator's, checked where it builds one (``pdd.wan.link``): what the
router or a PDDDeployment may declare is any positive rate.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from typing import TypeVar

from pydantic import BaseModel, ConfigDict

from pdd.common.settings import add_settings, flag_values, setting, settings_of


class WanLine(BaseModel):
    """One WAN line: its rate, delay, jitter and how a cut ends.

    Defaults, where its users' differed: the rate has none, since a line is run or declared
    at a rate someone states (``pdd wan-link --link-gbps`` is required, as the CRD's
    ``declaredGbps`` is); ``pdd up``'s line is ``pdd.local.topology.DEFAULT_LINK`` (sized
    for the tiny model) and the router assumes 10 Gbit/s where none is declared. Delay and
    jitter are 0 (the emulator's and the router's: a line adds none unless told), the cut's
    grace 5 s (the emulator's; a local stack's ``LinkSpec`` resets after 1 s)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gbps: float = setting(
        ...,
        "the WAN line's provisioned rate in each direction, Gbit/s (its connections share it)",
        flag="link_gbps",
    )
    rtt_ms: float = setting(0.0, "the WAN line's round-trip time, ms", flag="link_rtt_ms")
    jitter_ms: float = setting(
        0.0, "the most extra one-way delay a chunk on the WAN line gets, ms", flag="link_jitter_ms"
    )
    partition_grace_s: float = setting(
        5.0, "how long a cut line holds connections open before they are reset, s"
    )


Line = TypeVar("Line", bound=WanLine)


def add_line_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    line: WanLine | None = None,
    *,
    only: Iterable[str] | None = None,
) -> None:
    """The line's flags (those of ``only``'s fields, if given): with ``line``, its values
    are their defaults (``pdd up``'s line); without, the model's, and the rate, which has
    none, is required (``pdd wan-link``)."""
    table = settings_of(WanLine)
    if line is not None:
        table = [dataclasses.replace(s, default=getattr(line, s.name)) for s in table]
    add_settings(
        parser, [dataclasses.replace(s, required=s.default is None) for s in table], only=only
    )


def parsed_line(args: argparse.Namespace, kind: type[Line]) -> Line:
    """The line the flags ``add_line_flags`` made describe, as ``kind`` (a setting whose
    flag the parser lacks keeps ``kind``'s default: ``pdd up``'s cut keeps ``LinkSpec``'s)."""
    return kind(**flag_values(settings_of(kind), args))


def line_argv(line: WanLine) -> list[str]:
    """The ``pdd wan-link`` flags that run ``line``: written from the table its parser is
    generated from, so a setting added to the model reaches the emulator."""
    return [part for s in settings_of(WanLine) for part in (s.flag, f"{getattr(line, s.name):g}")]
