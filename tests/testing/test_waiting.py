"""``pdd.testing.waiting.until``: a condition polled until it holds, sync or async."""

from __future__ import annotations

import pytest

from pdd.testing.waiting import WaitTimeout, until

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]


async def test_an_async_condition_is_awaited_until_it_holds() -> None:
    polls = []

    async def third_poll() -> int | None:
        polls.append(1)
        return len(polls) if len(polls) == 3 else None

    assert await until(third_poll, "three polls") == 3


async def test_a_condition_that_never_holds_ends_at_the_deadline() -> None:
    async def never() -> bool:
        return False

    with pytest.raises(WaitTimeout, match="never: not within 1"):
        await until(never, "never", timeout_s=1)
