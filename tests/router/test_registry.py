"""Which instances new requests may go to after a request failed on one."""

from __future__ import annotations

import pytest

from pdd.common.vocabulary import Role
from pdd.common.wire import Endpoint
from pdd.router.config import WorkerRef
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig
from pdd.router.registry import InstanceRegistry
from pdd.router.worker_client import WorkerCallError, WorkerClient

pytestmark = pytest.mark.unit


def registry(*workers: tuple[Role, str]) -> InstanceRegistry:
    """A registry whose workers all answered their last poll."""
    refs = tuple(WorkerRef(role, f"http://{name}", name) for role, name in workers)
    reg = InstanceRegistry(refs, WorkerClient("token"), PrefixIndex(PrefixIndexConfig(16)), 1.0)
    for inst in reg.all():
        name = inst.expected_id
        inst.endpoint = Endpoint(
            instance_id=name, http_url=inst.http_url, fast_addr="x:1", wan_addr="x:2"
        )
        reg._mark_ready(inst)  # what a good poll concludes
    return reg


def ids(instances) -> set[str]:
    return {i.instance_id for i in instances}


def test_a_suspect_is_avoided_while_its_role_has_another_instance() -> None:
    reg = registry((Role.PREFILL, "p0"), (Role.PREFILL, "p1"), (Role.MAIN, "md0"))
    reg.suspect("p0", "a request failed on it")
    assert ids(reg.ready(Role.PREFILL)) == {"p1"}
    assert ids(reg.routable()) == {"p1", "md0"}


def test_the_only_instance_of_a_role_stays_routable_when_suspected() -> None:
    """A cut line fails a request on a healthy MD too: with no other MD, leaving it out
    would answer every new request 503 until the next poll."""
    reg = registry((Role.PREFILL, "p0"), (Role.MAIN, "md0"))
    reg.suspect("md0", "a request failed on it")
    assert ids(reg.ready(Role.MAIN)) == {"md0"}
    assert ids(reg.routable()) == {"p0", "md0"}


def test_a_failed_poll_still_leaves_the_only_instance_out() -> None:
    reg = registry((Role.PREFILL, "p0"), (Role.MAIN, "md0"))
    md = next(i for i in reg.all() if i.instance_id == "md0")
    reg._set_problem(md, "connection refused")  # what a failed poll does
    assert reg.ready(Role.MAIN) == []
    assert ids(reg.routable()) == {"p0"}


class RecordingClient:
    """The router's ``warm_wan_peers`` calls, as a worker would take them; calls to a URL
    in ``down`` fail as an unreachable worker's do."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.down: set[str] = set()

    async def warm_wan_peers(self, http_url: str, main_decodes: list[Endpoint]) -> None:
        if http_url in self.down:
            raise WorkerCallError(f"{http_url}/v1/pdd/wan-peers", "connection refused")
        self.calls.append((http_url, sorted(e.instance_id for e in main_decodes)))

    def take(self) -> list[tuple[str, list[str]]]:
        calls, self.calls = sorted(self.calls), []
        return calls


async def test_prefill_workers_are_told_the_main_decodes_when_they_change() -> None:
    """Each ready P hears the ready MDs once per change (it opens WAN channels to them
    ahead of their first request); a P that could not be told is told at the next poll."""
    reg = registry(
        (Role.PREFILL, "p0"), (Role.PREFILL, "p1"), (Role.MAIN, "md0"), (Role.MAIN, "md1")
    )
    md1 = next(i for i in reg.all() if i.instance_id == "md1")
    reg._set_problem(md1, "connection refused")
    client = RecordingClient()
    reg._client = client
    await reg._tell_main_decodes()
    assert client.take() == [("http://p0", ["md0"]), ("http://p1", ["md0"])]
    await reg._tell_main_decodes()
    assert client.take() == []  # nothing changed: nobody is called
    client.down = {"http://p1"}
    reg._mark_ready(md1)
    await reg._tell_main_decodes()
    assert client.take() == [("http://p0", ["md0", "md1"])]
    client.down = set()
    await reg._tell_main_decodes()
    assert client.take() == [("http://p1", ["md0", "md1"])]
