"""A worker that answers its poll late stays routable for a while; one that refuses
the connection is left out at once.

On a loaded machine a prefill worker busy computing answered the router's cache-events
poll after the client's timeout; the router left it out on that one late answer, and as
the only prefill worker it took every request with it: 12 of a bench's first 15 requests
were refused 503 ("no prefill worker is ready") while it caught up. A late answer now
makes the worker a suspect (routable while its role has nobody better) until
``SLOW_POLLS_TO_LEAVE_OUT`` polls in a row time out; a refused connection, an error
status or a bad body still leave it out at the first poll. Here the router's own
registry polls scripted workers (``pdd.testing.scripted_worker``) over its own client,
whose network times out or refuses on demand.
"""

from __future__ import annotations

import pytest

from pdd.common.vocabulary import Role
from pdd.router.registry import SLOW_POLLS_TO_LEAVE_OUT
from pdd.router.runtime import RouterRuntime
from pdd.testing.scripted_worker import ScriptedWorkers

pytestmark = pytest.mark.unit


async def prefill_chosen(rt: RouterRuntime) -> str:
    route = await rt.dispatcher.route(list(range(40)), 8)
    return route.prefill.instance_id


async def test_the_only_prefill_worker_answering_late_keeps_serving_until_it_stays_silent():
    workers = ScriptedWorkers({"p": Role.PREFILL, "md": Role.MAIN})
    rt = workers.router()
    try:
        await rt.registry.poll_once()
        assert rt.ready()
        workers.slow = {"p"}
        for _ in range(SLOW_POLLS_TO_LEAVE_OUT - 1):
            await rt.registry.poll_once()
            assert rt.ready()  # no 503 for a worker that is only late
            assert await prefill_chosen(rt) == "p"
        await rt.registry.poll_once()  # silent poll after poll: it is left out
        assert not rt.ready()
        workers.slow = set()
        await rt.registry.poll_once()
        assert rt.ready()
        workers.slow = {"p"}  # the count started again at its good poll
        await rt.registry.poll_once()
        assert rt.ready()
    finally:
        await rt.close()


async def test_a_late_worker_is_avoided_while_its_role_has_a_prompt_one():
    workers = ScriptedWorkers({"p0": Role.PREFILL, "p1": Role.PREFILL, "md": Role.MAIN})
    rt = workers.router()
    try:
        await rt.registry.poll_once()
        workers.slow = {"p0"}
        await rt.registry.poll_once()
        assert {await prefill_chosen(rt) for _ in range(8)} == {"p1"}
    finally:
        await rt.close()


async def test_a_refused_connection_leaves_the_worker_out_at_once():
    workers = ScriptedWorkers({"p": Role.PREFILL, "md": Role.MAIN})
    rt = workers.router()
    try:
        await rt.registry.poll_once()
        workers.down = {"p"}
        await rt.registry.poll_once()
        assert not rt.ready()
    finally:
        await rt.close()


async def test_a_poll_that_times_out_connecting_is_late_too():
    """Issue 59, run 6: on the starved bench machine the router left MD out when its
    cache-events poll hit ``ConnectTimeout``, at the first one, and 54 requests got 503 "no
    main worker is ready". A live process on a reachable host completes a connection in its
    kernel; a connect that times out means a full accept queue or a router too busy to see
    it made: a host that answers late, not one that is gone (a refused connection says so)."""
    workers = ScriptedWorkers({"p": Role.PREFILL, "md": Role.MAIN})
    rt = workers.router()
    try:
        await rt.registry.poll_once()
        workers.unconnected = {"md"}
        for _ in range(SLOW_POLLS_TO_LEAVE_OUT - 1):
            await rt.registry.poll_once()
            assert rt.ready()  # no 503 for a worker that is only slow to connect
        await rt.registry.poll_once()
        assert not rt.ready()  # unreachable poll after poll: left out
    finally:
        await rt.close()
