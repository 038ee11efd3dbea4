"""Recovery in ``Generation``: the router's own code, with the worker streams scripted.

The streams are what ``relay_tokens`` yields for a plan (token events, then an
``UpstreamError`` naming the instance that broke); everything else is the router's:
what recovery asks the dispatcher for (``Dispatcher.attempt``; here: recorded), the detokenizer,
stop strings, usage and the recovery counter.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest

from pdd.common.vocabulary import Pipeline, Role
from pdd.common.wire import Endpoint, PipelinePlan, SamplingSpec, TokenEvent
from pdd.router import generation
from pdd.router.config import RouterConfig, WorkerRef
from pdd.router.dispatcher import Attempt
from pdd.router.errors import UpstreamError
from pdd.router.generation import Generation
from pdd.router.lease import Lease
from pdd.router.route import Route
from pdd.router.runtime import RouterRuntime

pytestmark = pytest.mark.unit

PROMPT = [104, 105, 33]  # "hi!" in the built-in byte tokenizer
OUTPUT = list(b"abcdefgh")
MAX_TOKENS = len(OUTPUT)


def endpoint(name: str) -> Endpoint:
    return Endpoint(instance_id=name, http_url=f"http://{name}", fast_addr="x:1", wan_addr="x:2")


class Script:
    """Each plan's stream: the output from its prompt's end, cut short on the instances
    in ``breaks`` (after ``after`` tokens) by an UpstreamError naming them."""

    def __init__(self, breaks: dict[str, int]) -> None:
        self.breaks = breaks
        self.plans: list[PipelinePlan] = []

    async def relay_tokens(
        self, plan: PipelinePlan, *_: object, **__: object
    ) -> AsyncIterator[TokenEvent]:
        self.plans.append(plan)
        assert plan.main is not None
        start = len(plan.prompt_ids) - len(PROMPT)  # a resumed plan carries the output so far
        cut = self.breaks.get(plan.main.instance_id)
        for seq, token in enumerate(OUTPUT[start : start + plan.sampling.max_tokens]):
            if cut is not None and seq == cut:
                raise UpstreamError(f"{plan.main.instance_id} broke", (plan.main.instance_id,))
            last = start + seq == MAX_TOKENS - 1
            yield TokenEvent(
                request_id=plan.request_id, seq=seq, token_id=token,
                source=plan.main.instance_id, finished=last,
                finish_reason="length" if last else None,
            )  # fmt: skip


@pytest.fixture
def runtime() -> RouterRuntime:
    ref = WorkerRef(Role.MONO, "http://md0", "md0")
    return RouterRuntime(RouterConfig(model="tiny", workers=(ref,), secret="s"))


def start(runtime: RouterRuntime, mains: Sequence[str], stop: list[str] | None = None):
    """A Generation whose dispatcher picks the next MD not excluded, as the real one would,
    and records what each attempt asked for: (excluded, the attempt's request id, emitted)."""
    calls: list[tuple[frozenset[str], str, list[int]]] = []

    class Dispatcher:
        async def attempt(
            self,
            prompt_ids: Sequence[int],
            sampling: SamplingSpec,
            exclude: frozenset[str] = frozenset(),
            emitted: Sequence[int] = (),
            *,
            request_id: str,
        ) -> Attempt:
            return attempt_for(prompt_ids, sampling, exclude, emitted, request_id)

    def attempt_for(
        prompt_ids: Sequence[int],
        sampling: SamplingSpec,
        exclude: frozenset[str],
        emitted: Sequence[int],
        request_id: str,
    ) -> Attempt:
        calls.append((exclude, request_id, list(emitted)))
        main = next(m for m in mains if m not in exclude)
        route = Route(Pipeline.MONO, "r", "c", prefill=None, relay=None, main=endpoint(main))
        left = sampling.model_copy(update={"max_tokens": sampling.max_tokens - len(emitted)})
        plan = route.plan(request_id, [*prompt_ids, *emitted], left, runtime.config)
        return Attempt(route, plan, Lease(runtime.store))

    runtime.dispatcher = Dispatcher()  # type: ignore[assignment]
    first = attempt_for(PROMPT, SamplingSpec(max_tokens=MAX_TOKENS), frozenset(), (), "req")
    gen = Generation(runtime, first, stop or [], 0.0)
    return gen, calls


async def text_of(gen: Generation) -> str:
    return "".join([d.text async for d in gen.deltas()])


def recoveries(runtime: RouterRuntime, kind: str) -> float:
    return runtime.metrics.recoveries.labels(kind)._value.get()


async def test_a_stream_broken_mid_output_resumes_at_the_next_position(runtime, monkeypatch):
    script = Script(breaks={"md0": 3})
    monkeypatch.setattr(generation, "relay_tokens", script.relay_tokens)
    gen, calls = start(runtime, ["md0", "md1"])
    assert await text_of(gen) == "abcdefgh"  # nothing repeated, nothing missing
    assert calls[1] == (frozenset({"md0"}), "req-r1", list(b"abc"))
    resumed = script.plans[1]
    assert resumed.prompt_ids == [*PROMPT, *b"abc"] and resumed.sampling.max_tokens == 5
    assert gen.completion_tokens == MAX_TOKENS and gen.finish_reason == "length"
    assert gen.usage().prompt_tokens == len(PROMPT)  # the client's prompt, not the replay
    assert recoveries(runtime, "resume") == 1 and recoveries(runtime, "redispatch") == 0


async def test_a_failure_before_any_token_is_a_redispatch(runtime, monkeypatch):
    monkeypatch.setattr(generation, "relay_tokens", Script(breaks={"md0": 0}).relay_tokens)
    gen, calls = start(runtime, ["md0", "md1"])
    assert await text_of(gen) == "abcdefgh"
    assert calls[1] == (frozenset({"md0"}), "req-r1", [])
    assert recoveries(runtime, "redispatch") == 1 and recoveries(runtime, "resume") == 0


async def test_a_stop_string_spanning_the_break_still_cuts(runtime, monkeypatch):
    monkeypatch.setattr(generation, "relay_tokens", Script(breaks={"md0": 3}).relay_tokens)
    gen, _ = start(runtime, ["md0", "md1"], stop=["cde"])
    assert await text_of(gen) == "ab" and gen.finish_reason == "stop"


async def test_recovery_gives_up_after_its_limit_with_the_error(runtime, monkeypatch):
    breaks = {"md0": 2, "md1": 1, "md2": 1, "md3": 1}
    monkeypatch.setattr(generation, "relay_tokens", Script(breaks=breaks).relay_tokens)
    gen, calls = start(runtime, ["md0", "md1", "md2", "md3"])
    with pytest.raises(UpstreamError, match="md2 broke"):
        await text_of(gen)
    assert len(calls) == 1 + generation.MAX_RECOVERIES
    assert calls[-1][0] == {"md0", "md1"}  # every instance that failed stays excluded
