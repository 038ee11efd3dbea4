"""Send a synthesized trace through the router's OpenAI API, as its clients would.

Every chain is one client: it waits for its start offset, then sends its requests one
after another, each ``think_s`` after the previous answer finished streaming. Spawned
chains (subagents) start beside their parent without blocking it; start offsets, think
times and spawn delays are trace seconds, which a ``RateSteps`` paces (``--rate-steps``:
the trace's own pace by default). Requests go to
``/v1/completions`` with the token IDs as the prompt, streamed, greedy, with
``ignore_eos`` so output lengths follow the trace. A request too long for the model is
not sent: it is recorded as skipped and its chain goes on. A 429 is retried as the
OpenAI Python client retries it by default (twice, after ``Retry-After`` where it says
0-60 s, else 0.5 s doubling, jittered; TTFT counts from the first send); other statuses
it would retry (408, 409, 5xx) are recorded, not retried, so a fault shows. A failed
request is recorded with how it failed (``ErrorKind``) and why.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import httpx

from pdd.bench.rate_steps import STEADY, RateSteps
from pdd.bench.synth import Job
from pdd.local.traces.base import Chain, Trace

#: How a request failed, as the client saw it: an OpenAI error body with an error status
#: (``body``) or an SSE error frame mid-stream (``frame``) are the clean ways; an error
#: status without that body, a broken connection or a stream that just stops are not.
ErrorKind = Literal["body", "frame", "malformed", "transport", "incomplete"]
CLEAN_ERRORS: tuple[ErrorKind, ...] = ("body", "frame")
#: The OpenAI Python client's defaults: ``max_retries``, and its backoff's first and
#: longest delay and the longest ``Retry-After`` it honours, seconds.
MAX_RETRIES = 2
BACKOFF_S = (0.5, 8.0)
RETRY_AFTER_MAX_S = 60.0


@dataclass
class Outcome:
    """What the client saw of one request; times in seconds."""

    key: str
    prompt_tokens: int
    max_tokens: int
    sent_at: float = 0.0  # since the replay began
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # since sent, per streamed frame
    text: str = ""
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    #: A short, countable reason: ``HTTP 503 service_unavailable``, ``frame upstream_error``.
    error_reason: str | None = None
    skipped: bool = False
    retries: int = 0  # 429s retried before the answer (or the error) above

    @property
    def ok(self) -> bool:
        return not self.skipped and self.error is None

    @property
    def failed_cleanly(self) -> bool:
        return self.error_kind in CLEAN_ERRORS

    def fail(self, kind: ErrorKind, reason: str, message: str) -> None:
        self.error_kind, self.error_reason, self.error = kind, reason, message

    @property
    def gaps(self) -> list[float]:
        """Time between consecutive streamed frames (inter-token latency as seen)."""
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass(frozen=True)
class ReplayTarget:
    base_url: str  # e.g. http://127.0.0.1:8080/v1
    model: str
    request_timeout_s: float = 300.0
    api_key: str | None = None


class Replayer:
    """Runs one workload against one target; ``on_outcome`` is called per request."""

    def __init__(
        self,
        target: ReplayTarget,
        on_outcome: Callable[[Outcome], None] = lambda _: None,
        transport: httpx.AsyncBaseTransport | None = None,
        pace: RateSteps = STEADY,
    ) -> None:
        self.target = target
        self.on_outcome = on_outcome
        self._transport = transport
        self.pace = pace
        self.outcomes: list[Outcome] = []
        #: When the replay began, on the event loop's clock (``time.monotonic()`` on a
        #: default loop; a test's virtual clock paces a replay without waiting); every
        #: time of an outcome is on that clock, ``sent_at`` counts from this.
        self.t0 = 0.0
        self._tasks: set[asyncio.Task] = set()

    async def run(self, workload: Trace[Job]) -> list[Outcome]:
        headers = {"Authorization": f"Bearer {self.target.api_key}"} if self.target.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(self.target.request_timeout_s, connect=30.0)
        async with httpx.AsyncClient(
            limits=limits, timeout=timeout, headers=headers, transport=self._transport
        ) as client:
            self._client = client
            self.t0 = _now()
            for chain in workload.chains:
                self._launch(chain, delay_s=self.pace.replay_at(chain.start_s))
            while self._tasks:
                await asyncio.gather(*list(self._tasks))
        return self.outcomes

    def _launch(self, chain: Chain[Job], delay_s: float) -> None:
        task = asyncio.create_task(self._run_chain(chain, delay_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_chain(self, chain: Chain[Job], delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self._spawn_after(chain, -1)
        for i, job in enumerate(chain.requests):
            if i > 0:
                await asyncio.sleep(self.pace.wait_s(job.think_s, _now() - self.t0))
            outcome = await self._send(job)
            self.outcomes.append(outcome)
            self.on_outcome(outcome)
            self._spawn_after(chain, i)

    def _spawn_after(self, chain: Chain[Job], index: int) -> None:
        for spawn in chain.spawns:
            if spawn.after == index:
                now = _now() - self.t0
                self._launch(spawn.chain, self.pace.wait_s(spawn.delay_s, now))

    async def _send(self, job: Job) -> Outcome:
        out = Outcome(job.key, len(job.prompt_ids), job.max_tokens)
        out.sent_at = _now() - self.t0
        if not job.fits:
            out.skipped = True
            return out
        body = {
            "model": self.target.model,
            "prompt": list(job.prompt_ids),
            "max_tokens": job.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = _now()
        try:
            while (wait_s := await self._stream(body, out, start)) is not None:
                out.retries += 1
                out.error = out.error_kind = out.error_reason = None
                await asyncio.sleep(wait_s)
        except httpx.HTTPError as exc:
            out.fail("transport", type(exc).__name__, f"{type(exc).__name__}: {exc}")
        except json.JSONDecodeError as exc:
            out.fail("malformed", "frame not JSON", f"a frame that is not JSON: {exc}")
        out.e2e_s = _now() - start
        if out.error is None and out.finish_reason is None:
            reason = "stream ended without a finish_reason"
            out.fail("incomplete", reason, reason)
        return out

    async def _stream(self, body: dict, out: Outcome, start: float) -> float | None:
        """One attempt; the seconds to wait before the next where it was a 429 the OpenAI
        client would retry, else None."""
        url = f"{self.target.base_url}/completions"
        async with self._client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                _apply_error_body(resp.status_code, text, out)
                if resp.status_code == 429 and out.retries < MAX_RETRIES:
                    return retry_wait_s(resp.headers.get("retry-after"), out.retries)
                return None
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return None
                _apply_frame(json.loads(data), out, _now() - start)
        return None


def retry_wait_s(retry_after: str | None, retries: int) -> float:
    """The OpenAI client's wait before retry ``retries + 1``: the server's ``Retry-After``
    seconds where in (0, 60], else its backoff (0.5 s doubling to 8 s, less up to 25%)."""
    try:
        said = float(retry_after) if retry_after is not None else 0.0
    except ValueError:  # an HTTP date: the client would parse it; the router sends seconds
        said = 0.0
    if 0 < said <= RETRY_AFTER_MAX_S:
        return said
    first, longest = BACKOFF_S
    return min(first * 2**retries, longest) * (1 - 0.25 * random.random())


def _now() -> float:
    return asyncio.get_running_loop().time()


def _apply_error_body(status: int, text: str, out: Outcome) -> None:
    """An error status: clean when its body is the OpenAI error shape."""
    message = f"HTTP {status}: {text[:300]}"
    try:
        detail = json.loads(text)["error"]
        out.fail("body", f"HTTP {status} {detail['type']}", message)
    except (ValueError, KeyError, TypeError):
        out.fail("malformed", f"HTTP {status} without an OpenAI error body", message)


def _apply_frame(frame: dict, out: Outcome, elapsed: float) -> None:
    """One SSE frame: an error, a usage-only frame, or a token frame."""
    if "error" in frame:
        error = frame["error"]
        message = str(error.get("message", error))
        out.fail("frame", f"frame {error.get('type', 'error')}", message)
        return
    usage = frame.get("usage")
    if usage:
        out.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        out.cached_tokens = details.get("cached_tokens")
    for choice in frame.get("choices", []):
        if out.ttft_s is None:
            out.ttft_s = elapsed
        out.chunk_times.append(elapsed)
        out.text += choice.get("text") or ""
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]
