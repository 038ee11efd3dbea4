"""Wire schemas between the router and the workers' control APIs.

The router never imports the worker: it speaks to workers only through these
models, so they live here, torch-free. A request is described once, as a
:class:`PipelinePlan` naming every instance it visits; each instance reads the
part that concerns it. Tokens come back as :class:`TokenEvent` lines numbered by
output position, so a client-side merger can join the streams of several
instances into one gapless, duplicate-free stream (see ``token_stream.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdd.common.cache_events import (  # torch-free pydantic models, re-exported for the router
    CACHE_EVENT_LIST_ADAPTER,
    AllCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
)
from pdd.common.kv_codec import KVCodec
from pdd.common.vocabulary import FinishReason, LinkFault, Pipeline, Role, ToolCallFormat

__all__ = [
    "CACHE_EVENT_LIST_ADAPTER",
    "AllCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheEvent",
    "CacheEventsPage",
    "Endpoint",
    "EngineInfo",
    "GuidedDecoding",
    "GuidedTool",
    "HandoffAccepted",
    "HandoffIds",
    "LoadReport",
    "PipelinePlan",
    "RequestAccepted",
    "RequestCancelled",
    "SamplingSpec",
    "StateReport",
    "TakeoverAccepted",
    "TokenEvent",
    "TokenLogprobs",
    "TopLogprob",
]

HandoffMode = Literal["auto", "one-shot", "catch-up"]

#: ``error.type`` of a worker's 400 for a request it can never take, whatever its load
#: (its prompt over ``max_prompt_tokens`` or the context window, its prompt plus
#: ``max_tokens`` over the whole KV pool): the client's 400, not a worker to route around.
REQUEST_TOO_LARGE_ERROR_TYPE = "request_too_large"

#: Which instances each pipeline needs, by plan field.
PIPELINE_STAGES: dict[Pipeline, tuple[str, ...]] = {
    Pipeline.P_RLD_MD: ("prefill", "relay", "main"),
    Pipeline.P_MD: ("prefill", "main"),
    Pipeline.P_RLD: ("prefill", "relay"),
    Pipeline.NAIVE: ("prefill", "main"),
    Pipeline.MONO: ("main",),
}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Endpoint(_Wire):
    """One worker instance and its three addresses.

    ``fast_addr`` is reached from the same datacenter, ``wan_addr`` across the
    WAN (in tests: through a link emulator). Both lead to the same data port.
    """

    instance_id: str = Field(min_length=1)
    http_url: str = Field(min_length=1)
    fast_addr: str = Field(min_length=1, description="HOST:PORT of the data plane, in-datacenter")
    wan_addr: str = Field(min_length=1, description="HOST:PORT of the data plane, WAN-facing")


class GuidedTool(_Wire):
    """A function a forced tool call may name, with its arguments' JSON Schema as text."""

    name: str = Field(min_length=1)
    parameters_json: str = '{"type": "object"}'


class GuidedDecoding(_Wire):
    """Output constrained by a grammar (structured output): what every instance that
    samples the request compiles into the same token mask.

    ``json_object``: any JSON object. ``json_schema``: JSON valid against
    ``schema_text``. ``tool_calls``: the model's tool-call text (``tool_call_format``)
    naming one of ``tools`` with arguments valid against its parameters; exactly one call
    when ``single_call`` (a named ``tool_choice``), else one or more (``"required"``).

    A resumed request's grammar starts after the output already sent, which its prompt
    carries (``SamplingSpec.prior_output_tokens``).
    """

    kind: Literal["json_object", "json_schema", "tool_calls"]
    schema_text: str | None = None
    tools: tuple[GuidedTool, ...] = ()
    tool_call_format: ToolCallFormat = ToolCallFormat.HERMES
    single_call: bool = True

    @model_validator(mode="after")
    def _complete(self) -> GuidedDecoding:
        if self.kind == "json_schema" and self.schema_text is None:
            raise ValueError("guided decoding of kind json_schema needs schema_text")
        if self.kind == "tool_calls" and not self.tools:
            raise ValueError("guided decoding of kind tool_calls needs at least one tool")
        return self


#: The range of ``repetition_penalty`` (1 = off): a seen token's logit is divided (or
#: multiplied) by it, so a value near 0 or huge overflows float32 logits to inf and the
#: distribution to NaN; [0.01, 100] keeps any real model's logits finite.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class SamplingSpec(_Wire):
    """How to sample; ``seed`` must be set for seeded sampling across instances.

    The one declaration of the sampling fields, their defaults and ranges: the worker's
    engine samples by this model itself (its ``SamplingParams`` subclass adds only what it
    derives), so a new field is a field here, its use in the engine, and a test.

    Penalties, ``min_tokens`` and ``logit_bias`` steer the logits from the request's own
    token history, which every instance holds (see docs/engine.md); ``logprobs`` asks
    each token's instance to report the token's logprob and that many alternatives.
    """

    max_tokens: int = Field(default=16, ge=1)
    #: 0: greedy.
    temperature: float = Field(default=0.0, ge=0.0)
    #: 0: off.
    top_k: int = Field(default=0, ge=0)
    #: 1: off.
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: OpenAI semantics, over the output tokens: ``logit -= presence * [count > 0]``
    #: and ``logit -= frequency * count``.
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    #: HF/vLLM semantics, over prompt and output tokens: a seen token's logit is divided
    #: by it when positive, multiplied when negative (1 = off).
    repetition_penalty: float = Field(
        default=1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    #: EOS (unless ``ignore_eos``) and ``stop_token_ids`` are masked until this many
    #: tokens are out.
    min_tokens: int = Field(default=0, ge=0)
    #: ``(token id, bias)`` pairs added to the logits (OpenAI ``logit_bias``), bias in
    #: [-100, 100].
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: None: no logprobs; n: the picked token's and the n most likely (OpenAI's limit, 20).
    logprobs: int | None = Field(default=None, ge=0, le=20)
    #: The prompt's last ``prior_output_tokens`` tokens are this request's own output from
    #: an earlier attempt (the router resumes a request that failed mid-stream with prompt
    #: = prompt + the tokens already sent). Whatever depends on the output history counts
    #: them as output: frequency/presence penalties, ``min_tokens`` and the grammar, so the
    #: resumed output is the unbroken one token for token (a seeded draw depends on the
    #: position in the whole sequence, which the resume keeps). ``max_tokens`` counts only
    #: the tokens this attempt adds.
    prior_output_tokens: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _valid_bias(self) -> SamplingSpec:
        bad = [(t, b) for t, b in self.logit_bias if t < 0 or not -100.0 <= b <= 100.0]
        if bad:
            raise ValueError(
                f"logit_bias needs token ids >= 0 and biases in [-100, 100]: {bad[:3]}"
            )
        return self

    #: Structured output: the grammar the output obeys.
    guided: GuidedDecoding | None = None


class PipelinePlan(_Wire):
    """Everything an instance needs to play its part in one request.

    For ``mono`` the request goes to ``main`` (the colocated instance).
    ``naive`` is cross-datacenter PD without PDD: P ships the full KV to MD.
    """

    request_id: str = Field(min_length=1, max_length=200)
    prompt_ids: list[int] = Field(min_length=1)
    sampling: SamplingSpec = SamplingSpec()
    pipeline: Pipeline = Pipeline.P_RLD_MD
    prefill: Endpoint | None = None
    relay: Endpoint | None = None
    main: Endpoint | None = None
    handoff: HandoffMode = "auto"
    catchup_threshold: int = Field(default=64, ge=1)
    #: The router's prediction of the prompt tokens MD already holds (its prefix index).
    #: P starts sending MD's KV from here at once instead of waiting a WAN round trip for
    #: MD's answer; MD asks for what it lacks below it and skips what it holds above it.
    #: None: no prediction, P waits for MD's answer (see docs/dataplane.md).
    main_hit_tokens: int | None = Field(default=None, ge=0)
    #: The codec P codes MD's KV with across the WAN, chosen by the router for this
    #: request (``spec.wan.kvCodec: adaptive``); None: the deployment's codec.
    kv_codec: KVCodec | None = None
    #: MD computes the KV it lacks from the prompt's token IDs instead of receiving it: P
    #: sends MD no KV (the router's choice where that is sooner than the KV's crossing,
    #: see ``md_prefills``; on P-RLD-MD, where the relay needs P's prefill, P sends MD the
    #: first token and MD computes its miss with the relay's IDs).
    md_computes_miss: bool = False
    #: The W3C trace context (``{"traceparent": ...}``) of the router's span for this
    #: request, so every instance's spans join its trace (``pdd.common.tracing``); None
    #: where tracing is off.
    trace_context: dict[str, str] | None = None

    @model_validator(mode="after")
    def _stages_present(self) -> PipelinePlan:
        missing = [s for s in PIPELINE_STAGES[self.pipeline] if getattr(self, s) is None]
        if missing:
            raise ValueError(f"pipeline {self.pipeline} needs endpoints for: {', '.join(missing)}")
        return self

    @model_validator(mode="after")
    def _prior_output_in_prompt(self) -> PipelinePlan:
        if self.sampling.prior_output_tokens >= len(self.prompt_ids):
            raise ValueError(
                f"sampling.prior_output_tokens ({self.sampling.prior_output_tokens}) must be "
                f"less than the prompt's {len(self.prompt_ids)} tokens: the prompt is the "
                "request's prompt followed by its earlier output"
            )
        return self

    @property
    def decode_sources(self) -> tuple[Endpoint, ...]:
        """The instances whose streams carry this request's tokens (relay first)."""
        if self.pipeline == "mono":
            return (self.main,)  # type: ignore[return-value]
        stages = PIPELINE_STAGES[self.pipeline]
        return tuple(getattr(self, s) for s in ("relay", "main") if s in stages)

    @property
    def md_prefills(self) -> bool:
        """P-MD where MD computes its miss: MD prefills and samples the first token itself
        and P computes nothing (it only hands MD the request on its warm channel)."""
        return self.md_computes_miss and self.pipeline == Pipeline.P_MD

    @property
    def ships_kv_over_wan(self) -> bool:
        """P sends MD its miss across the WAN (P-MD, P-RLD-MD, naive); P's own stream then
        reports a transfer that failed (``TokenEvent.link_fault``)."""
        stages = PIPELINE_STAGES[self.pipeline]
        return "prefill" in stages and "main" in stages


class TopLogprob(_Wire):
    token_id: int
    logprob: float


class TokenLogprobs(_Wire):
    """A token's logprob and the most likely alternatives at its position, from the
    instance that sampled it (``top`` is empty when none were asked for)."""

    logprob: float
    top: tuple[TopLogprob, ...] = ()


class KVShipment(_Wire):
    """P's report that MD imported the KV it sent across the WAN: ``kv_bytes`` of KV
    (uncoded: the unit the router's estimate counts in), ``seconds`` from P's first
    chunk on the line to MD's "imported". The router's goodput sample, timed where no
    prefill, P queue or relay hand-off is in it."""

    kv_bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)


#: ``TokenEvent.error_type`` of a request that failed in its own work on an instance (its
#: logits processing, its sampling, its logprobs; a grammar's failure is the
#: ``GRAMMAR_ERROR_TYPE`` of ``pdd.common.grammar``): any instance would fail it alike, so
#: the router ends it with the error instead of routing around the instance.
REQUEST_FAILED_ERROR_TYPE = "request_failed"


class TokenEvent(_Wire):
    """One line of a token stream.

    A token event has ``token_id`` set and ``seq`` = its output position
    (0-based). A status event (``token_id`` None) says a source stopped early:
    ``error`` set means it failed (the merger records it and the router routes
    around it); ``seq`` is then the next position it would have produced. The
    merged stream (``TokenStreamMerger``) has one more: ``finished`` without a
    token, the request's end after ``seq`` positions, where the last token went
    out before its instance knew it was the last (MD streams P's first token the
    moment it has it, before its engine has checked that token).

    Two prefix-cache facts ride on token events, for the router's usage report
    and its prefix index (measured, where the index only estimates):
    ``cached_tokens`` on the seq-0 event: prompt tokens the computing instance
    (P, or mono) took from its prefix cache instead of prefilling them;
    ``md_hit_tokens`` on the first event the main decode (or mono) streams:
    prompt tokens it held when the request reached it (absent for naive, which
    bypasses MD's cache).
    """

    request_id: str
    seq: int = Field(ge=0)
    token_id: int | None = None
    source: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    #: With ``error``: the instance whose failure ended this source's work where that was
    #: another one (the P whose KV stopped coming), so the router leaves that one out.
    culprit: str | None = None
    #: With ``error``: set where the request's own work failed, not the instance (its
    #: grammar: ``GRAMMAR_ERROR_TYPE``, the client's input; anything else:
    #: ``REQUEST_FAILED_ERROR_TYPE``). No other instance would do better, so the router
    #: ends the request with it (a 400 for the grammar) and blames no instance.
    error_type: str | None = None
    #: With ``error``, on P's stream: P's KV could not cross the WAN to ``culprit`` (the
    #: main decode), and how. P reports it at once, so the router need not wait for MD's
    #: transfer timeout to learn that MD will never get the request.
    link_fault: LinkFault | None = None
    #: A status event on P's stream (no token, no error): MD has P's KV (``KVShipment``).
    kv_shipped: KVShipment | None = None
    cached_tokens: int | None = Field(default=None, ge=0)
    md_hit_tokens: int | None = Field(default=None, ge=0)
    #: On token events of a request that asked for logprobs (``SamplingSpec.logprobs``).
    logprobs: TokenLogprobs | None = None

    @property
    def is_token(self) -> bool:
        return self.token_id is not None


class KVShape(_Wire):
    """The shape of a worker's KV cache, as its loaded checkpoint and dtype give it: what
    the operator sizes the WAN link with when the spec does not give ``model.config``."""

    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    dtype: str = Field(description="the KV cache's dtype (float32, bfloat16, ...)")
    bytes_per_token: int = Field(ge=1, description="K and V of one token over all layers")


class EngineInfo(_Wire):
    """What an instance's engine actually got (``GET /health``'s ``engine``, the start-up
    log line, the ``pdd_worker_engine_*`` gauges): settings resolved against the machine."""

    #: The inference engine serving this instance: PDD's own, or vLLM (issue 56).
    engine: Literal["pdd", "vllm"] = "pdd"
    device: str
    dtype: str
    dtype_reason: str = Field(
        default="", description="why this dtype: 'asked for', or how auto resolved here"
    )
    cpu_kernels: str | None = Field(
        default=None, description="the compiled CPU kernels' variant (avx2, ...); None: torch's"
    )
    block_size: int = Field(
        ge=1, description="tokens per KV block: a prompt's cached prefix is reused in whole "
        "blocks, so the router rounds its predicted hits on this instance down to them",
    )  # fmt: skip
    kv_blocks: int = Field(ge=1)
    kv_tokens: int = Field(ge=1, description="KV cache capacity: kv_blocks x block_size")
    kv_bytes: int = Field(ge=1)
    max_running_requests: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    max_prompt_tokens: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1, description="per-step token budget (chunked prefill)")
    #: None from a worker older than this field.
    kv_shape: KVShape | None = None


class WorkerHealth(_Wire):
    """What a worker's ``GET /health`` answers: who it is and what its engine got."""

    status: Literal["ok"] = "ok"
    role: Role
    endpoint: Endpoint
    engine: EngineInfo


class WorkerRefusal(_Wire):
    """What ``GET /health`` answers (with 503) from a worker whose engine settings its
    machine refuses: it stays up, not ready, saying why, instead of crash-looping."""

    status: Literal["misconfigured"] = "misconfigured"
    role: str
    instance_id: str
    problem: str


class LoadReport(_Wire):
    """What ``GET /load`` answers: the router's and the autoscaler's view of an instance."""

    instance_id: str
    role: Role
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    kv_blocks_free: int = Field(ge=0)
    kv_blocks_total: int = Field(ge=0)
    relay_load: float = Field(ge=0.0, le=1.0)
    capacity: int = Field(ge=1, description="requests it runs at once (its max_running_requests)")
    draining: bool = Field(
        default=False, description="shutting down: finishing what it runs, taking nothing new"
    )


class StateReport(_Wire):
    """``GET /v1/pdd/debug/state``: enough to prove, across processes, that nothing leaked.

    After every request has ended: ``live_requests`` is 0, ``kv_blocks_locked``
    is 0 (no prefix lock remains), and ``kv_blocks_free + kv_blocks_cached ==
    kv_blocks_total`` (every block is free or held only by the prefix cache).
    """

    instance_id: str
    live_requests: int
    engine_requests: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_locked: int
    kv_blocks_total: int
    #: The worker's asyncio tasks now (what a soak watches for growth; not a leak alone).
    asyncio_tasks: int = 0

    @property
    def quiescent(self) -> bool:
        return (
            self.live_requests == 0
            and self.engine_requests == 0
            and self.kv_blocks_locked == 0
            and self.kv_blocks_free + self.kv_blocks_cached == self.kv_blocks_total
        )


class CacheEventsPage(BaseModel):
    """``GET /v1/pdd/cache-events?since=N``: events with cursors ``since+1 .. next_cursor``.

    ``reset`` is True when events older than ``since`` were dropped (buffer
    overflow or a restart): the subscriber must drop its view of this instance
    and rebuild it from the events that follow.
    """

    instance_id: str
    next_cursor: int
    reset: bool = False
    events: list[CacheEvent]


class HandoffIds(_Wire):
    """``POST /v1/pdd/requests/{id}/handoff``: the tokens a dead relay already streamed."""

    token_ids: list[int]


class RequestAccepted(_Wire):
    """``POST /v1/pdd/requests`` (202): the worker took the plan."""

    request_id: str
    accepted_by: str


class RequestCancelled(_Wire):
    """``DELETE /v1/pdd/requests/{id}``: the worker stopped the request."""

    request_id: str
    cancelled: Literal[True] = True


class HandoffAccepted(_Wire):
    """``POST /v1/pdd/requests/{id}/handoff``: how many handed-over IDs MD took."""

    request_id: str
    accepted: int = Field(ge=0)


class TakeoverAccepted(_Wire):
    """``POST /v1/pdd/requests/{id}/takeover``: the relay finishes the request itself."""

    request_id: str
    takeover: Literal[True] = True


class WanPeers(_Wire):
    """``PUT /v1/pdd/wan-peers``: the main decodes a prefill worker ships KV to, named by
    the router as they join, so it opens a channel to each before their first request."""

    main_decodes: list[Endpoint]
