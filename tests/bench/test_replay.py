"""The replay scheduler against an in-process OpenAI-shaped endpoint (httpx transport).

The real router is exercised end to end in test_up.py; here the subject is the
client side: order and timing of sends, skipped requests, and how frames are read.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pdd.bench.replay import Replayer, ReplayTarget, retry_wait_s
from pdd.bench.synth import Job
from pdd.local.traces.base import Chain, Spawn, Trace

pytestmark = pytest.mark.unit


def sse(*frames: dict) -> bytes:
    body = "".join(f"data: {json.dumps(f)}\n\n" for f in frames) + "data: [DONE]\n\n"
    return body.encode()


def token_frame(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


class Endpoint:
    """Answers each completion with one frame per requested token, echoing the prompt's
    first id; records what was asked, in order."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        refusals = {999: 3, 998: 1}.get(body["prompt"][0], 0)  # 999: always (3 tries)
        if sum(b["prompt"][0] == body["prompt"][0] for b in self.bodies) <= refusals:
            error = {"error": {"message": "busy", "type": "rate_limit_error"}}
            return httpx.Response(429, json=error, headers={"Retry-After": "0.01"})
        n = body["max_tokens"]
        frames = [token_frame(chr(65 + body["prompt"][0] % 26)) for _ in range(n - 1)]
        usage = {"prompt_tokens": 3, "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip
        frames += [token_frame("!", "length"), {"choices": [], "usage": usage}]
        return httpx.Response(200, content=sse(*frames))


def job(key: str, first: int, think: float = 0.0, fits: bool = True) -> Job:
    return Job(key, (first, 1, 2), max_tokens=3, think_s=think, fits=fits)


async def run(trace: Trace[Job], endpoint: Endpoint):
    target = ReplayTarget("http://router/v1", "tiny")
    seen = []
    replayer = Replayer(target, seen.append, transport=httpx.MockTransport(endpoint))
    outcomes = await replayer.run(trace)
    return outcomes, seen


async def test_chain_turns_wait_for_answers_and_think_time() -> None:
    child = Chain("s/kid", 0.0, (job("kid#0", 7),))
    chain = Chain(
        "s", 0.0, (job("s#0", 1), job("s#1", 2, think=0.05), job("s#2", 3, fits=False)),
        (Spawn(0, 0.0, child),),
    )  # fmt: skip
    endpoint = Endpoint()
    outcomes, seen = await run(Trace("t", 64, (chain,)), endpoint)
    by_key = {o.key: o for o in outcomes}
    assert set(by_key) == {"s#0", "s#1", "s#2", "kid#0"}
    assert seen == outcomes
    assert by_key["s#1"].sent_at - by_key["s#0"].sent_at >= 0.05
    assert by_key["kid#0"].sent_at >= by_key["s#0"].sent_at  # spawned after turn 0
    assert by_key["s#2"].skipped and not by_key["s#2"].ok  # too long: never sent
    assert [b["prompt"][0] for b in endpoint.bodies if b["prompt"][0] != 7] == [1, 2]
    first = by_key["s#0"]
    assert first.ok and first.text == "BB!" and first.finish_reason == "length"
    assert (first.completion_tokens, first.cached_tokens) == (3, 2)
    assert len(first.chunk_times) == 3 and len(first.gaps) == 2
    body = endpoint.bodies[0]
    assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0


async def test_errors_are_recorded_and_the_chain_goes_on() -> None:
    chain = Chain("s", 0.0, (job("s#0", 999), job("s#1", 4)))
    outcomes, _ = await run(Trace("t", 64, (chain,)), Endpoint())
    bad, good = sorted(outcomes, key=lambda o: o.key)
    assert bad.error is not None and "429" in bad.error
    assert good.ok


async def test_a_429_is_retried_as_the_openai_client_retries_it() -> None:
    """Twice, after the router's Retry-After; the answer after a retry is a success whose
    TTFT counts from the first send, and a third refusal is the request's error."""
    endpoint = Endpoint()
    chain = Chain("s", 0.0, (job("s#0", 998), job("s#1", 999)))
    outcomes, _ = await run(Trace("t", 64, (chain,)), endpoint)
    by_key = {o.key: o for o in outcomes}
    retried, refused = by_key["s#0"], by_key["s#1"]
    assert retried.ok and retried.retries == 1 and retried.ttft_s is not None
    assert retried.ttft_s >= 0.01  # the Retry-After wait is the client's too
    assert refused.retries == 2 and refused.error_reason == "HTTP 429 rate_limit_error"
    assert [b["prompt"][0] for b in endpoint.bodies] == [998, 998, 999, 999, 999]


def test_without_a_usable_retry_after_the_wait_is_the_clients_backoff() -> None:
    assert retry_wait_s("2", 0) == 2.0
    for said in (None, "0", "120", "Wed, 21 Oct 2026 07:28:00 GMT"):
        assert 0.375 <= retry_wait_s(said, 0) <= 0.5
    assert 6.0 <= retry_wait_s(None, 5) <= 8.0  # doubling, capped at 8 s


async def test_chains_start_at_their_offsets() -> None:
    chains = (Chain("late", 0.1, (job("late#0", 5),)), Chain("early", 0.0, (job("early#0", 6),)))
    outcomes, _ = await run(Trace("t", 64, chains), Endpoint())
    by_key = {o.key: o for o in outcomes}
    assert by_key["late#0"].sent_at >= 0.1 > by_key["early#0"].sent_at


async def test_how_a_request_failed_is_recorded_clean_or_not() -> None:
    """An OpenAI error body or an SSE error frame is a clean failure; an error status
    without that body, or a stream that stops without a finish, is not."""

    def answer(request: httpx.Request) -> httpx.Response:
        first = json.loads(request.content)["prompt"][0]
        error = {"error": {"message": "no prefill worker is ready", "type": "service_unavailable"}}
        if first == 1:
            return httpx.Response(503, json=error)
        if first == 2:
            return httpx.Response(200, content=sse(token_frame("A"), error))
        if first == 3:
            return httpx.Response(502, text="Bad Gateway")
        return httpx.Response(200, content=sse(token_frame("A")))  # no finish_reason

    chain = Chain("s", 0.0, tuple(job(f"s#{i}", i) for i in (1, 2, 3, 4)))
    target = ReplayTarget("http://router/v1", "tiny")
    outcomes = await Replayer(target, transport=httpx.MockTransport(answer)).run(
        Trace("t", 64, (chain,))
    )
    seen = {o.key: (o.error_kind, o.error_reason, o.failed_cleanly) for o in outcomes}
    assert seen == {
        "s#1": ("body", "HTTP 503 service_unavailable", True),
        "s#2": ("frame", "frame service_unavailable", True),
        "s#3": ("malformed", "HTTP 502 without an OpenAI error body", False),
        "s#4": ("incomplete", "stream ended without a finish_reason", False),
    }
    assert all(not o.ok and o.error for o in outcomes)
