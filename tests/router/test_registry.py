"""Which instances new requests may go to after a request failed on one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.common.vocabulary import Role
from pdd.common.wire import Endpoint, EngineInfo
from pdd.router.config import WorkerRef
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig
from pdd.router.registry import InstanceRegistry
from pdd.router.worker_client import WorkerCallError, WorkerClient

pytestmark = pytest.mark.unit


#: Never called by these tests; one for all, as building one is slow.
CLIENT = WorkerClient("token")


def registry(*workers: tuple[Role, str]) -> InstanceRegistry:
    """A registry whose workers all answered their last poll."""
    refs = tuple(WorkerRef(role, f"http://{name}", name) for role, name in workers)
    reg = InstanceRegistry(refs, CLIENT, PrefixIndex(PrefixIndexConfig(16)), 1.0)
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


def engine(kv_tokens: int, max_model_len: int) -> EngineInfo:
    return EngineInfo(
        device="cpu", dtype="float32", block_size=16, kv_blocks=kv_tokens // 16,
        kv_tokens=kv_tokens, kv_bytes=1, max_running_requests=8, max_model_len=max_model_len,
        max_prompt_tokens=max_model_len - 1, max_num_batched_tokens=512,
    )  # fmt: skip


WORKERS = ((Role.PREFILL, "p0"), (Role.PREFILL, "p1"), (Role.RELAY, "r0"), (Role.MAIN, "md0"),
           (Role.MAIN, "md1"), (Role.MONO, "m0"))  # fmt: skip
ROLE_SETS = ((Role.MAIN, Role.RELAY, Role.MONO), (Role.PREFILL, Role.MAIN, Role.RELAY, Role.MONO))
limits_step = st.one_of(
    st.tuples(st.just("ready"), st.integers(0, 5), st.sampled_from([1024, 2048, 4096]),
              st.sampled_from([512, 1024, 2048])),
    st.tuples(st.just("fail"), st.integers(0, 5), st.just(0), st.just(0)),
    st.tuples(st.just("suspect"), st.integers(0, 5), st.just(0), st.just(0)),
    st.tuples(st.just("gone"), st.integers(0, 5), st.just(0), st.just(0)),
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.lists(limits_step, max_size=40))
def test_the_limits_a_request_is_checked_against_equal_a_pass_over_the_fleet(steps) -> None:
    """Each request reads the context window and the KV pools of the ready instances;
    kept as polls, failures and departures come, they must equal a pass over every
    instance (the old reading, O(fleet) per request) after any of them."""
    reg = registry(*WORKERS)
    known = reg.all()
    for op, k, kv_tokens, max_model_len in steps:
        inst = known[k]
        if op == "ready":  # a (re)identified instance answered a poll
            inst.engine = engine(kv_tokens, max_model_len)
            reg._mark_ready(inst)
        elif op == "fail":
            reg._set_problem(inst, "connection refused")
        elif op == "suspect" and inst.instance_id is not None:
            reg.suspect(inst.instance_id, "a request failed on it")
        elif op == "gone" and reg._instances.pop(inst.http_url, None) is not None:
            reg._touch(inst)  # what a Service host no longer resolving to it does
        ready = [i for i in reg.all() if i.ready and i.engine is not None]
        assert reg.context_limit() == min((i.engine.max_model_len for i in ready), default=None)
        for roles in ROLE_SETS:
            kv = [i.engine.kv_tokens for i in ready if i.role in roles]
            assert reg.kv_limit(roles) == min(kv, default=None)


class InstancesNotToWalk(dict):
    """The registry's instances, which a request's checks may not walk through."""

    def values(self):
        raise AssertionError("walked every instance for one request's limits")

    def __iter__(self):
        raise AssertionError("walked every instance for one request's limits")


def test_a_requests_limits_are_read_without_walking_the_fleet() -> None:
    reg = registry(*WORKERS)
    for inst in reg.all():
        inst.engine = engine(2048, 1024)
        reg._mark_ready(inst)
    reg._instances = InstancesNotToWalk(reg._instances)
    assert reg.context_limit() == 1024
    assert reg.kv_limit(ROLE_SETS[0]) == 2048


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
