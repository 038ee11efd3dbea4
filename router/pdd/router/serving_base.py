"""What both OpenAI endpoints share: checks, sampling, routing a prompt, the result type.

Per endpoint a serving class (``serving_chat``, ``serving_completions``) turns a
validated request into a :class:`Served`: a response model, or an async iterator of
SSE frames, plus the route (the app puts ``x-pdd-pipeline`` and ``x-pdd-reason`` on
the response). Problems are raised as typed ``RouterError``s; in the middle of a
stream they become an ``ErrorResponse`` frame followed by ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from urllib.parse import quote

from pydantic import BaseModel

from pdd.common.vocabulary import FinishReason, Role
from pdd.common.wire import GuidedDecoding, SamplingSpec
from pdd.router import access_log
from pdd.router.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    RequestTooLargeError,
    RouterError,
)
from pdd.router.generation import Generation, TokenLogprobEntry
from pdd.router.metrics import COMPUTED_AT_MD
from pdd.router.openai_protocol import SSE_DONE, ErrorResponse, SamplingFields, new_id, sse_frame
from pdd.router.route import Route
from pdd.router.runtime import RouterRuntime
from pdd.router.samples import Samples

log = logging.getLogger(__name__)

#: The roles that hold a request's whole KV, prompt and output (P holds the prompt and
#: its first token only).
DECODE_ROLES = (Role.RELAY, Role.MAIN, Role.MONO)


@dataclass(frozen=True)
class Choice:
    """One sample's whole output."""

    text: str
    finish_reason: FinishReason | None
    #: Each output token's logprobs, where the request asked for them.
    logprobs: tuple[TokenLogprobEntry, ...] = ()


@dataclass(frozen=True)
class Served:
    generation: Generation
    body: BaseModel | AsyncGenerator[bytes, None]

    @property
    def headers(self) -> dict[str, str]:
        """Where the request went and why; header values must be latin-1, so the reason
        (ASCII in practice) is percent-quoted to be safe."""
        route = self.generation.route
        hops = [("prefill", route.prefill, route.p_hit_tokens), ("relay", route.relay, None)]
        hops.append(("main", route.main, route.md_hit_tokens))
        path = " ".join(
            f"{role}={ep.instance_id}" + (f":{hit}" if hit is not None else "")
            for role, ep, hit in hops
            if ep is not None
        )
        return {
            "x-pdd-request-id": self.generation.plan.request_id,
            "x-pdd-pipeline": route.pipeline,
            "x-pdd-reason": quote(route.reason, safe=" :;,.()=<>/%+-_'"),
            "x-pdd-route": path,
        }


class OpenAIServing:
    def __init__(self, runtime: RouterRuntime) -> None:
        self.runtime = runtime

    def check(self, request: SamplingFields) -> None:
        served = self.runtime.config.served_name
        if request.model != served:
            raise ModelNotFoundError(
                f"model {request.model!r} is not served here; this router serves {served!r}",
                param="model",
            )

    def sampling(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        sample: int = 0,
        guided: GuidedDecoding | None = None,
        prompt_tokens: int = 0,
    ) -> SamplingSpec:
        """OpenAI's sampling fields in the workers' terms (top_k -1 means off: 0 there).
        A request without ``max_tokens`` gets the default, within the router's limit and
        the context the prompt leaves; one whose prompt plus ``max_tokens`` exceeds the
        model's context window is a 400 naming both numbers, as vLLM answers it; so is one
        over the KV cache of the workers that decode it (``RequestTooLargeError``: they
        would refuse it whatever their load, so it is no 429), and the default stays
        within that cache too. Sample ``i`` of ``n`` draws with ``seed + i``, so the
        samples differ.
        ``guided``: the grammar the output must follow (structured output)."""
        config = self.runtime.config
        limit = config.max_tokens_limit
        if limit is not None and max_tokens is not None and max_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens {max_tokens} is more than this router allows ({limit})",
                param="max_tokens",
            )
        default = min(config.default_max_tokens, limit or config.default_max_tokens)
        context = self.runtime.registry.context_limit()
        if context is not None:
            left = context - prompt_tokens
            if max_tokens is not None and max_tokens > left:
                raise ContextLengthError(
                    f"max_tokens is too large: {max_tokens}. This model's maximum context "
                    f"length is {context} tokens and your request has {prompt_tokens} input "
                    f"tokens ({max_tokens} > {context} - {prompt_tokens})",
                    param="max_tokens",
                )
            default = max(1, min(default, left))
        room = self.runtime.registry.kv_limit(DECODE_ROLES)
        if room is not None:
            left = room - prompt_tokens
            if max_tokens is not None and max_tokens > left:
                raise RequestTooLargeError(
                    f"max_tokens is too large: {max_tokens}. This deployment's workers hold "
                    f"at most {room} tokens of KV cache for one request (its input and output "
                    f"tokens together) and your request has {prompt_tokens} input tokens "
                    f"({max_tokens} > {room} - {prompt_tokens})",
                    param="max_tokens",
                )
            default = max(1, min(default, left))
        if request.min_tokens > (max_tokens or default):
            raise InvalidRequestError(
                f"min_tokens {request.min_tokens} is more than max_tokens "
                f"{max_tokens or default}" + ("" if max_tokens else " (the default)"),
                param="min_tokens",
            )
        self._check_token_ids(request)
        return SamplingSpec(
            max_tokens=max_tokens or default,
            temperature=request.temperature,
            top_k=max(0, request.top_k),
            top_p=request.top_p,
            seed=None if request.seed is None else request.seed + sample,
            ignore_eos=request.ignore_eos,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            min_tokens=request.min_tokens,
            logit_bias=request.logit_bias_pairs,
            logprobs=request.logprobs_count,
            guided=guided,
        )

    def _check_prompt_room(self, prompt_tokens: int, param: str) -> None:
        """The prompt and one output token must fit the KV cache of every worker that
        holds it (P, and the decoding ones), or no worker could ever take it."""
        room = self.runtime.registry.kv_limit((Role.PREFILL, *DECODE_ROLES))
        if room is not None and prompt_tokens + 1 > room:
            raise RequestTooLargeError(
                f"the prompt has {prompt_tokens} tokens; this deployment's workers hold at "
                f"most {room} tokens of KV cache for one request (its input and at least one "
                "output token together): shorten the prompt",
                param=param,
            )

    def _check_token_ids(self, request: SamplingFields) -> None:
        """``stop_token_ids`` and ``logit_bias`` keys must name tokens of the vocabulary."""
        vocab = self.runtime.tokenizer.tokenizer.vocab_size
        for param, ids in (
            ("stop_token_ids", request.stop_token_ids or []),
            ("logit_bias", [t for t, _ in request.logit_bias_pairs]),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"{param} names token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                    param=param,
                )

    async def start_samples(
        self,
        prompt_ids: list[int],
        request: SamplingFields,
        max_tokens: int | None,
        param: str,
        guided: GuidedDecoding | None = None,
    ) -> Samples:
        """The request's ``n`` samples; the first is routed now (its refusal is the
        request's 4xx/5xx), the others after it passed prefill (``Samples``)."""
        first = await self.start(prompt_ids, request, max_tokens, param, 0, guided)

        def start(sample: int) -> Awaitable[Generation]:
            return self.start(prompt_ids, request, max_tokens, param, sample, guided)

        return Samples(first, request.n, start)

    async def start(
        self,
        prompt_ids: list[int],
        request: SamplingFields,
        max_tokens: int | None,
        param: str,
        sample: int = 0,
        guided: GuidedDecoding | None = None,
    ) -> Generation:
        """Check the prompt's length, route it, and hold the route's in-flight lease
        (``Dispatcher.attempt``, which a recovery asks again: ``Generation``)."""
        arrived_at = time.monotonic()
        limit = self.runtime.prompt_limit()
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty after templating", param=param)
        if limit is not None and len(prompt_ids) > limit:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens; this router accepts at most {limit}",
                param=param,
            )
        self._check_prompt_room(len(prompt_ids), param)
        request_id = new_id("pdd")
        sampling = self.sampling(request, max_tokens, sample, guided, len(prompt_ids))

        first = await self.runtime.dispatcher.attempt(prompt_ids, sampling, request_id=request_id)
        if sample == 0:  # the request's route; later samples follow the first
            self._record(first.route, len(prompt_ids))
        return Generation(self.runtime, first, request.stop_strings, arrived_at)

    def _record(self, route: Route, prompt_tokens: int) -> None:
        m = self.runtime.metrics
        m.requests.labels(route.pipeline, route.reason_code).inc()
        if route.ships_kv and (route.kv_codec is not None or route.md_computes_miss):
            m.kv_codec_choices.labels(
                COMPUTED_AT_MD if route.md_computes_miss else route.kv_codec
            ).inc()
        if route.prefill is not None:
            m.prefix_hit_ratio.labels("prefill").observe(route.p_hit_tokens / prompt_tokens)
        if route.main is not None:
            m.prefix_hit_ratio.labels("main").observe(route.md_hit_tokens / prompt_tokens)

    async def collect_samples(self, samples: Samples) -> list[Choice]:
        """Every sample's whole text and finish reason (non-streaming), by index."""
        texts = [""] * samples.n
        finishes: list[FinishReason | None] = [None] * samples.n
        logprobs: list[list[TokenLogprobEntry]] = [[] for _ in range(samples.n)]
        async for index, delta in samples.deltas():
            texts[index] += delta.text
            finishes[index] = delta.finish_reason or finishes[index]
            logprobs[index] += delta.logprobs
        return [
            Choice(text, finish, tuple(entries))
            for text, finish, entries in zip(texts, finishes, logprobs, strict=True)
        ]

    async def sse(self, frames: AsyncGenerator[BaseModel, None]) -> AsyncGenerator[bytes, None]:
        """SSE bytes of ``frames``, then ``[DONE]``; an error mid-stream becomes one
        ``ErrorResponse`` frame (the status line has already gone out)."""
        try:
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    yield sse_frame(frame)
        except RouterError as exc:
            self.runtime.metrics.rejected.labels(exc.cause).inc()
            _note_refusal(exc.cause, exc.message)
            yield sse_frame(exc.body())
        except Exception as exc:  # the client must get an error frame, whatever broke
            log.exception("stream failed")
            self.runtime.metrics.rejected.labels("internal").inc()
            message = f"internal error in the stream: {exc!r}"
            _note_refusal("internal", message)
            yield sse_frame(ErrorResponse.of(message, "internal_error", code=500))
        yield SSE_DONE


def _note_refusal(cause: str, message: str) -> None:
    """The access-log line of this request says why it failed mid-stream."""
    record = access_log.current()
    if record is not None:
        record.refused(cause, message)
