"""Which earlier requests a new one waits for before MD attaches it (``LandingKV``)."""

from __future__ import annotations

import asyncio

import pytest

from pdd.worker.roles.landing import LandingKV

pytestmark = pytest.mark.unit

BS = 4
SYSTEM = list(range(100, 112))  # three full blocks every conversation starts with


def test_a_conversation_s_next_turn_waits_for_the_last_one_even_if_its_prompt_is_cached() -> None:
    landing = LandingKV(BS)
    turn1 = [*SYSTEM, 1, 2, 3, 4, 5]
    landing.expect("t1", turn1)
    turn2 = [*turn1, 50, 51, 52, 53, 9, 9]  # the answer (not known to MD yet), a new message
    landing.expect("t2", turn2)
    assert len(landing.ahead_of("t2", turn2, cached=16)) == 1  # its answer may still come
    landing.landed("t1")
    assert landing.ahead_of("t2", turn2, cached=16) == []


def test_another_conversation_waits_only_for_blocks_the_cache_lacks() -> None:
    landing = LandingKV(BS)
    landing.expect("a", [*SYSTEM, 1, 2, 3, 4, 5])
    other = [*SYSTEM, 7, 7, 7, 7, 7]
    landing.expect("b", other)
    assert len(landing.ahead_of("b", other, cached=0)) == 1  # "a" brings the system prompt
    assert landing.ahead_of("b", other, cached=12) == []  # already cached: nothing to wait for


def test_an_answer_learnt_later_extends_what_the_request_brings() -> None:
    landing = LandingKV(BS)
    landing.expect("t1", [*SYSTEM, 1])
    retry = [*SYSTEM, 1, 50, 51, 52, 53]  # shares turn 1's prompt and its answer's block
    landing.expect("r", [*SYSTEM, 2, 50, 51, 52])
    landing.answered("t1", [50, 51, 52, 53])
    assert len(landing.ahead_of("x", retry, cached=12)) == 1  # "t1" now brings 16 tokens


def test_only_earlier_requests_are_waited_for() -> None:
    landing = LandingKV(BS)
    first = [*SYSTEM, 1]
    landing.expect("first", first)
    landing.expect("later", [*first, 2, 3])
    assert landing.ahead_of("first", first, cached=0) == []


async def test_the_wait_ends_when_the_kv_landed_or_at_the_bound() -> None:
    landing = LandingKV(BS)
    turn1 = [*SYSTEM, 1]
    turn2 = [*turn1, 2, 3]
    landing.expect("t1", turn1)
    landing.expect("t2", turn2)

    async def cached() -> int:
        return 0

    waiting = asyncio.ensure_future(landing.wait_ahead("t2", turn2, cached, timeout_s=3600))
    landing.landed("t1")
    await asyncio.wait_for(waiting, 60)
    landing.expect("t3", [*turn2, 4])
    await asyncio.wait_for(landing.wait_ahead("t3", [*turn2, 4], cached, timeout_s=0.0), 60)


async def test_the_cache_is_not_asked_when_no_earlier_request_shares_a_block() -> None:
    landing = LandingKV(BS)
    landing.expect("a", [1, 2, 3, 4, 5])
    landing.expect("b", [9, 9, 9, 9, 9])
    asked: list[int] = []

    async def cached() -> int:
        asked.append(1)
        return 0

    await asyncio.wait_for(landing.wait_ahead("b", [9, 9, 9, 9, 9], cached, 3600), 60)
    assert asked == []  # no round trip to the engine thread on the request's path
