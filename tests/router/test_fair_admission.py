"""Router-wide admission: slots go to the keys in turn, and a wait for one is bounded."""

import asyncio

import pytest

from pdd.router.fair_admission import FairAdmission, OverloadedError
from pdd.testing.waiting import until

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]


async def test_a_noisy_key_cannot_starve_a_quiet_one():
    """Five noisy waiters queued before one quiet waiter: the quiet one gets the second
    slot that frees, not the sixth."""
    admission = FairAdmission(capacity=2, max_wait_s=600.0, retry_after_s=1.0)
    held = [await admission.admit("noisy"), await admission.admit("noisy")]
    order: list[str] = []

    async def wait(key: str) -> None:
        await admission.admit(key)
        order.append(key)

    waiting = []
    for queued, key in enumerate(["noisy"] * 5 + ["quiet"], start=1):
        waiting.append(asyncio.create_task(wait(key)))
        await until(lambda n=queued: admission.queued == n, f"{key} queued")  # in this order
    assert admission.queued == 6 and admission.admitted == 2
    held[0]()
    held[0]()  # a release is idempotent: this frees nothing more
    await until(lambda: order, "the first freed slot taken")
    assert order == ["noisy"]
    held[1]()
    await until(lambda: len(order) == 2, "the second freed slot taken")
    assert order == ["noisy", "quiet"]
    assert admission.held == {"noisy": 1, "quiet": 1} and admission.queued == 4
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert admission.queued == 0  # cancelled waiters leave the queue


async def test_the_wait_for_a_slot_is_bounded_and_then_429():
    admission = FairAdmission(capacity=1, max_wait_s=0.5, retry_after_s=2.0)
    release = await admission.admit("a")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(OverloadedError) as refused:
        await admission.admit("b")
    assert loop.time() - started == pytest.approx(0.5)  # virtual time: exactly the bound
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "2"}
    assert admission.queued == 0  # the refused waiter left the queue
    release()
    assert admission.admitted == 0
    assert (await admission.admit("b")) is not None  # free again: admitted at once


async def test_a_full_queue_refuses_at_once():
    admission = FairAdmission(capacity=1, max_wait_s=600.0, retry_after_s=1.0, max_queued=2)
    await admission.admit("a")
    waiting = [asyncio.create_task(admission.admit("a")) for _ in range(2)]
    await until(lambda: admission.queued == 2, "both waiters queued")
    with pytest.raises(OverloadedError, match="already waiting"):
        await admission.admit("b")
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert admission.queued == 0


async def test_without_a_capacity_everything_is_admitted():
    admission = FairAdmission(capacity=None, max_wait_s=0.5, retry_after_s=1.0)
    releases = [await admission.admit("k") for _ in range(100)]
    assert admission.admitted == 100 and admission.held == {"k": 100}
    for release in releases:
        release()
    assert admission.admitted == 0 and admission.held == {}
