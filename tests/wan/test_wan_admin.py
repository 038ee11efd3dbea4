"""The WAN link's admin API refuses values outside the line's bounds, and answers JSON.

``{"gbps": 1e-300}`` used to stall the line for good, and 1e308 made its rate infinite
and the answer ``"gbps": Infinity``, which no JSON parser takes. Every value is now a
finite number within ``MIN_GBPS``..``MAX_GBPS`` (or the delays' bounds), refused with a
400 and the reason otherwise; the routes run in-process here (``handle``), their HTTP
face in ``test_wan_link_process``.
"""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from pdd.wan.admin import HttpError, answer, handle
from pdd.wan.bottleneck import MAX_GBPS, MIN_GBPS
from pdd.wan.link import MAX_DELAY_MS, Route, WanLink
from pdd.wan.stats import LinkStats

pytestmark = pytest.mark.unit


def strict_json(body: bytes) -> object:
    """JSON as RFC 8259 has it: ``Infinity`` and ``NaN`` are not numbers."""

    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(body.split(b"\r\n\r\n", 1)[1], parse_constant=refuse)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"gbps": 1e-300}', "gbps: Input should be greater than or equal to 0.000001"),
        (b'{"gbps": 1e308}', "gbps: Input should be less than or equal to 10000"),
        (b'{"gbps": 1e400}', "gbps: Input should be a finite number"),
        (b'{"gbps": NaN}', "gbps: Input should be a finite number"),
        (b'{"gbps": Infinity}', "gbps: Input should be a finite number"),
        (b'{"gbps": 0}', "gbps: Input should be greater than or equal to 0.000001"),
        (b'{"gbps": "fast"}', "gbps: Input should be a valid number"),
    ],
)
async def test_a_rate_outside_the_bounds_is_a_400_with_the_reason(body: bytes, reason: str) -> None:
    link = WanLink("127.0.0.1:0", "127.0.0.1:1", gbps=1)
    with pytest.raises(HttpError) as caught:
        handle(link, "POST", "/rate", body)
    assert caught.value.status == 400
    assert str(caught.value).startswith(reason)
    assert link.forward.gbps == link.reverse.gbps == pytest.approx(1.0)


@pytest.mark.parametrize("gbps", [MIN_GBPS, MAX_GBPS])
async def test_the_bounds_themselves_are_taken_and_answered_in_strict_json(gbps: float) -> None:
    link = WanLink("127.0.0.1:0", "127.0.0.1:1", gbps=1)
    reply = strict_json(answer(link, "POST", "/rate", json.dumps({"gbps": gbps}).encode()))
    assert isinstance(reply, dict) and reply["gbps"] == pytest.approx(gbps)
    handle(link, "POST", "/rate", b'{"gbps": 1}')  # and back: no rescale turned infinite
    assert link.forward.gbps == pytest.approx(1.0)


async def test_an_answer_never_holds_a_non_finite_number() -> None:
    link = WanLink("127.0.0.1:0", "127.0.0.1:1", gbps=1)
    with pytest.raises(ValidationError, match="finite number"):
        LinkStats.model_validate({**link.stats().model_dump(), "gbps": math.inf})
    link.rtt_ms = math.inf  # past every bound the line checks: a bug, answered as one
    reply = answer(link, "GET", "/stats", b"")
    assert reply.startswith(b"HTTP/1.1 500 ")
    assert strict_json(reply) == {"error": "the line's state holds a non-finite number"}


async def test_the_in_process_view_is_the_answer_on_the_wire() -> None:
    """``WanLink.stats()`` is the ``LinkStats`` that ``GET /stats`` sends, one type, not a
    dict kept in step with the model by hand (issue 57: a fact is written once)."""
    route = Route("127.0.0.1:0", "127.0.0.1:2")
    link = WanLink("127.0.0.1:0", "127.0.0.1:1", gbps=2, rtt_ms=30, extra_routes=[route])
    stats = link.stats()
    assert isinstance(stats, LinkStats)
    assert (stats.gbps, stats.rtt_ms, stats.routes[0].to) == (2, 30, "127.0.0.1:2")
    assert (stats.forward.bytes, stats.connections.total, stats.cut) == (0, 0, False)
    assert handle(link, "GET", "/stats", b"") == stats
    assert strict_json(answer(link, "GET", "/stats", b"")) == json.loads(stats.model_dump_json())


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"gbps": 1e308}, "link rate must be from 1e-06 to 10000 Gbit/s"),
        ({"gbps": math.nan}, "link rate must be from 1e-06 to 10000 Gbit/s"),
        ({"gbps": 1, "rtt_ms": math.nan}, "rtt_ms must be from 0 to 60000 ms"),
        ({"gbps": 1, "rtt_ms": MAX_DELAY_MS * 2}, "rtt_ms must be from 0 to 60000 ms"),
        ({"gbps": 1, "jitter_ms": math.inf}, "jitter_ms must be from 0 to 60000 ms"),
        ({"gbps": 1, "partition_grace_s": math.inf}, "partition_grace_s must be from 0 to 3600"),
    ],
)
def test_a_line_is_not_built_with_settings_outside_the_bounds(setting, message) -> None:
    with pytest.raises(ValueError, match=message):
        WanLink("127.0.0.1:0", "127.0.0.1:1", **setting)
