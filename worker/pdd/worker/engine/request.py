"""One request's state inside the engine, its outputs, and the typed request errors.

A request is a token sequence ``prompt_ids + output_ids`` plus how much of it
has KV in the cache (``num_computed``). Everything the scheduler does reduces
to "compute ``tokens[num_computed:]``": a prefill (maybe in chunks), a decode
(the one token sampled last step) or an extend (token IDs handed over by
another instance) are the same operation with a different length.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pdd.common.wire import TokenLogprobs
from pdd.worker.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestError(ValueError):
    """A request the engine cannot take; the message says why and what to change."""


class PromptTooLongError(RequestError):
    """The prompt does not fit the model's context window."""


class RequestTooLargeError(RequestError):
    """The request could never fit the KV pool, even with the pool to itself."""


class NoFreeBlocksError(RequestError):
    """No KV blocks for this right now, even after eviction and preemption; retry later."""


class UnknownRequestError(RequestError, KeyError):
    """No live request has this id (never added, already finished, or aborted)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class InvalidRequestStateError(RequestError):
    """The operation does not apply to the request in its current state."""


class RequestFailedError(RuntimeError):
    """A live request the engine gave up on (``RequestOutput.error``): ``error_type`` is
    set where its own work failed, not the instance (``TokenEvent.error_type``)."""

    def __init__(self, message: str, error_type: str | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for admission (new, or preempted and requeued for recompute)
    RUNNING = "running"  # holds blocks; gets tokens computed each step
    AWAITING_KV = "awaiting_kv"  # attached: holds blocks, waits for imported KV and resume()
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens or the context window reached
    STOP = "stop"  # EOS or a stop token id was sampled
    ABORT = "abort"


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: the tokens it sampled this step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    error: str | None = None  # set when the engine gave up on the request (finish is ABORT)
    #: With ``error``: the request's own work failed, not the step (``TokenEvent.error_type``).
    error_type: str | None = None
    #: One per new token when the request asked for logprobs (``SamplingParams.logprobs``).
    logprobs: list[TokenLogprobs] | None = None
    #: On the output carrying a prefill's first token: seconds from the step that began
    #: computing the prompt to that token (queueing before it excluded), as vLLM's
    #: ``request_prefill_time_seconds`` counts it; None on every other output.
    prefill_time_s: float | None = None
    #: On the same output: seconds from ``add_request`` to the step that first scheduled
    #: the request (its wait in the queue), as vLLM's ``request_queue_time_seconds``
    #: counts it; None on every other output, and for a request whose KV came from elsewhere.
    queue_time_s: float | None = None


@dataclass(frozen=True)
class RequestLimits:
    """What any request must fit: the vocabulary, the context window and the KV pool."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_prompt_tokens: int  # at most max_model_len - 1: one token must fit after the prompt

    def check_params(self, params: SamplingParams) -> None:
        """Token ids the parameters name must be in the vocabulary."""
        self.check_tokens(params.stop_token_ids, "stop_token_ids")
        self.check_tokens([t for t, _ in params.logit_bias], "logit_bias")

    def check_prompt(self, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
        prompt = self.check_tokens(prompt_ids, "prompt")
        if not prompt:
            raise RequestError("prompt is empty; pass at least one token id")
        if len(prompt) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt)} tokens; the context window is {self.max_model_len}, "
                "which must leave room for at least one generated token: shorten the prompt"
            )
        if len(prompt) > self.max_prompt_tokens:
            raise PromptTooLongError(
                f"prompt has {len(prompt)} tokens; this instance takes at most "
                f"{self.max_prompt_tokens} (max_prompt_tokens): shorten the prompt"
            )
        self.check_fits(min(len(prompt) + max_tokens, self.max_model_len))
        return prompt

    def check_appended(self, req: Request, token_ids: Sequence[int]) -> list[int]:
        """Token IDs handed over to ``req`` from another instance."""
        tokens = self.check_tokens(token_ids, "handed-over tokens")
        total = req.num_tokens + len(tokens)
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"request {req.request_id!r} would hold {total} tokens; the context window is "
                f"{self.max_model_len}"
            )
        self.check_fits(total)
        return tokens

    def check_tokens(self, token_ids: Sequence[int], what: str) -> list[int]:
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"{what} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        return ids

    def check_fits(self, num_tokens: int) -> None:
        blocks = -(-num_tokens // self.block_size)
        if blocks > self.num_blocks:
            raise RequestTooLargeError(
                f"request needs up to {num_tokens} tokens of KV ({blocks} blocks) but the pool "
                f"has {self.num_blocks} blocks in all; lower max_tokens or the prompt, or "
                "raise the KV budget"
            )


class OutputGrammar(Protocol):
    """A request's structured-output matcher (``grammar.GrammarState``), as the request
    and the engine use it."""

    @property
    def complete(self) -> bool: ...

    def advance(self, output_ids: Sequence[int]) -> None: ...

    def allowed(self) -> torch.Tensor: ...


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    hold_kv: bool = False  # keep the blocks after finishing until Engine.release()
    use_cache: bool = True  # False: never matched against nor inserted into the prefix cache
    #: True: its KV came (in part) through a codec whose KV the cache must not share
    #: (``pdd.common.kv_codec.shared_in_receiver_cache``): it may hit the prefix cache,
    #: but adds nothing to it, and neither does anything computed on top of that KV.
    private_kv: bool = False
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens[:num_computed] have KV in block_table
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    block_table: list[int] = field(default_factory=list)  # one pool reference held per entry
    prefix_handle: object | None = None  # locked prefix-cache node, released on free
    hold_sampling: bool = False  # catch-up handoff: compute handed-over tokens, do not sample yet
    cache_only: bool = False  # finished elsewhere: compute the handed tokens, then release
    unchunked: bool = False  # an extend is pending: compute all uncomputed tokens in one pass
    #: A prefill chunk ends at this token position (None: the step budget alone sets the
    #: chunks): a prefill whose KV streams to a slow line puts the first KV the receiver
    #: lacks on it after a short step.
    chunk_break: int | None = None
    finish_reason: FinishReason | None = None
    grammar: OutputGrammar | None = None  # structured output: the matcher over output_ids
    #: When the step that first computed its prompt began (``Engine.clock``); None until
    #: then, and for a request that never prefills here (its KV came from elsewhere).
    prefill_started_at: float | None = None
    #: When ``Engine.add_request`` queued it (``Engine.clock``); None for a request attached
    #: with its KV from elsewhere, which never waits in the admission queue.
    queued_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without copying the whole sequence (hot path: every step)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Blocks to add so that the table covers ``num_tokens`` slots."""
        return max(0, -(-num_tokens // block_size) - len(self.block_table))

    def stop_reason(
        self, eos_token_ids: tuple[int, ...], max_model_len: int
    ) -> FinishReason | None:
        """Why the request is done after its last appended token, or None to keep going."""
        if self.grammar is not None and self.grammar.complete:
            return FinishReason.STOP
        return finish_reason_after(
            self.output_ids, self.params, eos_token_ids, self.num_tokens, max_model_len
        )


def finish_reason_after(
    output_ids: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Collection[int],
    num_tokens: int,
    max_model_len: int,
) -> FinishReason | None:
    """Why a request with ``output_ids`` (``num_tokens`` with its prompt) is done, its
    grammar aside, or None to keep going: a stop id or EOS last, else its length. One rule
    for the pdd engine's own samples and for IDs sampled elsewhere that vLLM's roles'
    engine takes over (a relay's), so both engines end a request alike."""
    last = output_ids[-1] if output_ids else None
    if last is not None and last in params.stop_token_ids:
        return FinishReason.STOP
    if last is not None and not params.ignore_eos and last in eos_token_ids:
        return FinishReason.STOP
    if len(output_ids) >= params.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
