"""The inference engine: continuous batching over a paged, prefix-cached KV pool.

``step()`` is the whole story: the scheduler picks who computes how many tokens
(decodes, prefill chunks, extends), one batched forward pass computes them
(``forward``), and requests whose pass reached the end of their sequence sample their
next token.

The handoff API (``extend``, ``export_kv``, ``attach_request``, ``import_kv``,
``resume``, ``finished_elsewhere``: both ends of PDD's handoffs) is the engine's too,
delegated to the ``Handoff`` it owns (``handoff``) over the same live requests
(``request_table``); the KV pool's size comes from ``kv_budget``. Options and stats are
``config``. See docs/engine.md.

Everything here is single-threaded: call it from one thread (the worker's
event loop runs it in an executor).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from pdd.common.cache_events import CacheEvent
from pdd.common.grammar import GRAMMAR_ERROR_TYPE
from pdd.common.kv_codec import NO_CODEC, KVCodec
from pdd.common.tokenizer import Tokenizer
from pdd.common.wire import REQUEST_FAILED_ERROR_TYPE as FAILED
from pdd.common.wire import EngineInfo, KVShape, TokenLogprobs
from pdd.worker.cpu_allocator import keep_freed_memory
from pdd.worker.engine.block_pool import BlockPool
from pdd.worker.engine.config import EngineConfig, EngineStats
from pdd.worker.engine.device import SYSTEM_PROBE, DeviceProbe, load_on_device
from pdd.worker.engine.forward import last_token_logits
from pdd.worker.engine.grammar import GrammarCompiler, GrammarStateError, mask_logits
from pdd.worker.engine.handoff import Handoff
from pdd.worker.engine.isolation import per_row, stage
from pdd.worker.engine.kv_budget import blocks_for_budget
from pdd.worker.engine.radix_cache import RadixCache
from pdd.worker.engine.request import (
    FinishReason,
    NoFreeBlocksError,
    Request,
    RequestFailedError,
    RequestLimits,
    RequestOutput,
    RequestStatus,
)
from pdd.worker.engine.request_table import RequestTable
from pdd.worker.engine.sampling import (
    SamplingParams,
    output_history,
    process_logits,
    sample,
    token_logprobs,
)
from pdd.worker.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from pdd.worker.model.kv_cache import KVLayout, PagedKVCache
from pdd.worker.model.loader import LoadedModel

log = logging.getLogger(__name__)

#: One sampled row: its token and, where asked, the token's logprobs.
Picked = tuple[int, TokenLogprobs | None]


class Engine:
    """Continuous-batching engine for one model on one device.

    ``model`` is ``"tiny"``, a checkpoint directory, or an already loaded model
    (several engines may share one ``LoadedModel``: weights are read-only).
    Options are an ``EngineConfig`` and/or its fields as keywords:
    ``Engine("tiny", block_size=4, num_blocks=64)``. Loader errors
    (``ModelLoadError`` subclasses) propagate unchanged.
    """

    def __init__(
        self,
        model: str | LoadedModel,
        config: EngineConfig | None = None,
        probe: DeviceProbe = SYSTEM_PROBE,
        **options: object,
    ) -> None:
        config = replace(config or EngineConfig(), **options)  # type: ignore[arg-type]
        self.config = config
        if isinstance(model, LoadedModel):
            self.loaded, self.dtype_reason = model, "as loaded by the caller"
        else:
            self.loaded, self.dtype_reason = load_on_device(model, config, probe)
        self.model_config = self.loaded.config
        self.device = torch.device(self.loaded.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.layout = KVLayout.from_config(self.model_config, config.block_size, self.loaded.dtype)
        num_blocks = config.num_blocks or blocks_for_budget(config, self.layout, self.device, probe)
        self.kv = PagedKVCache(self.layout, num_blocks, self.device)
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(self.pool, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.block_size,
                config.max_num_batched_tokens,
                min(config.max_running_requests, config.max_num_batched_tokens),
            ),
            self.pool,
            self.cache,
        )
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.limits = RequestLimits(
            self.model_config.vocab_size,
            self.max_model_len,
            config.block_size,
            num_blocks,
            min(config.max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1),
        )
        self.grammars = GrammarCompiler(self.loaded.tokenizer, self.model_config.vocab_size)
        self.requests = RequestTable(self.limits, self.grammars, self.scheduler)
        self.handoff = Handoff(self.requests, self.scheduler, self.cache, self.kv, self.fingerprint)
        #: Times prefills (``RequestOutput.prefill_time_s``); tests drive it.
        self.clock: Callable[[], float] = time.monotonic

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    # --- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        hold_kv: bool = False,
        chunk_break: int | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises a ``RequestError`` (state unchanged).

        ``hold_kv`` keeps the request's blocks after it finishes, so its KV can be
        exported (a prefill instance's job); call :meth:`release` afterwards.
        ``chunk_break``: a prefill chunk ends at this token position (where it falls
        past the cache hit), so the KV up to it is written after a shorter step.
        """
        req = self.requests.new(prompt_ids, params, request_id, hold_kv)
        req.chunk_break, req.queued_at = chunk_break, self.clock()
        self.scheduler.add(req)
        self.requests.add(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and give back everything it holds (any state)."""
        req = self.requests.get(request_id)
        self.scheduler.finish(req)
        req.finish_reason = req.finish_reason or FinishReason.ABORT
        self._release(req)

    def fail_scheduled(self, error: str) -> list[RequestOutput]:
        """Abort every queued or running request after a failed step; one output each.

        Only the step's shared part (the scheduler, the forward pass) can fail it: a
        failure in one request's own work ends that request alone (``isolation``).
        A step that raised left those requests in an unknown state: retrying them
        would most likely fail the same way forever, so each ends with ``error`` and
        gives back its blocks and locks. Attached requests (awaiting KV) were not part
        of the step and stay.
        """
        failed = [*self.scheduler.running, *self.scheduler.waiting]
        for req in failed:
            self.abort(req.request_id)
        return [
            RequestOutput(r.request_id, [], True, FinishReason.ABORT, error=error) for r in failed
        ]

    def has_unfinished(self) -> bool:
        """True when ``step()`` has work: queued requests or running ones with tokens to compute.

        Attached requests (awaiting KV) and held ones that caught up wait for a
        ``resume``/``extend`` call instead, so a serving loop can block until then.
        """
        return self.scheduler.has_work

    # --- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batched forward pass; return what each sampling request produced."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        began = self.clock()
        for s in scheduled:
            if s.request.prefill_started_at is None and not s.request.output_ids:
                s.request.prefill_started_at = began
        logits = last_token_logits(self.loaded.model, self.kv, scheduled, self.config.block_size)
        return self._postprocess(scheduled, logits)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[list[int]]:
        """Run ``prompts`` to completion (alongside anything already queued); their outputs."""
        per = params if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per, strict=True)]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        pending = set(ids)
        while pending:
            outs = self.step()
            if not outs and not self.scheduler.running:
                raise NoFreeBlocksError(
                    f"{len(pending)} requests cannot be admitted: the KV pool is held by attached "
                    "or finished hold_kv requests; release or abort them"
                )
            for out in outs:
                if out.request_id in outputs:
                    outputs[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        pending.discard(out.request_id)
        return [outputs[i] for i in ids]

    def _postprocess(
        self, scheduled: list[ScheduledSeq], logits: torch.Tensor
    ) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        rows: list[int] = []
        for row, s in enumerate(scheduled):
            req = s.request
            completes = s.completes
            req.num_computed += s.num_tokens
            if completes and req.cache_only:  # its KV is computed: nothing to sample
                outputs.append(self._finish(req, FinishReason.STOP, []))
                continue
            if not completes or req.hold_sampling:
                continue
            req.unchunked = False
            try:
                self._catch_up(req)
            except RequestFailedError as e:
                outputs.append(self._fail(req, str(e), e.error_type))
                continue
            reason = req.stop_reason(self._eos, self.max_model_len) if req.output_ids else None
            if reason is not None:  # handed-over tokens already ended it
                outputs.append(self._finish(req, reason, []))
            else:
                rows.append(row)
        sampling = [scheduled[r].request for r in rows]
        picks = per_row(self._sample, logits[rows], sampling)
        sampled_at = self.clock()
        for req, pick in zip(sampling, picks, strict=True):
            try:
                if isinstance(pick, RequestFailedError):
                    raise pick
                outputs.append(self._append(req, *pick, sampled_at))
            except RequestFailedError as e:
                outputs.append(self._fail(req, str(e), e.error_type))
        return outputs

    @staticmethod
    def _catch_up(req: Request) -> None:
        """Advance ``req``'s grammar over handed-over tokens before its pick. One the
        grammar refuses is an untyped failure: no instance with the same grammar could
        have sampled it, so it is a bug or a mismatched pipeline, not the request's."""
        if req.grammar is None:
            return
        try:
            req.grammar.advance(req.output_ids)
        except GrammarStateError as e:
            raise RequestFailedError(str(e)) from e
        except Exception as e:
            raise RequestFailedError(
                f"the structured-output grammar failed: {e}", GRAMMAR_ERROR_TYPE
            ) from e

    def _append(
        self, req: Request, token: int, lp: TokenLogprobs | None, sampled_at: float
    ) -> RequestOutput:
        """``req``'s new token, its grammar advanced over it, and whether it ends it."""
        prefill_s = _prefill_time(req, sampled_at)
        queue_s = None if prefill_s is None else _queue_time(req)
        req.output_ids.append(token)
        if req.grammar is not None:  # its own mask allowed the token: a failure is its own
            with stage("the structured-output grammar's advance", GRAMMAR_ERROR_TYPE):
                req.grammar.advance(req.output_ids)
        reason = req.stop_reason(self._eos, self.max_model_len)
        lps = None if lp is None else [lp]
        if reason is not None:
            return self._finish(req, reason, [token], lps, prefill_s, queue_s)
        return RequestOutput(
            req.request_id, [token], False, None, req.num_cached_tokens, logprobs=lps,
            prefill_time_s=prefill_s, queue_time_s=queue_s,
        )  # fmt: skip

    def _fail(self, req: Request, error: str, error_type: str | None = None) -> RequestOutput:
        """End ``req`` with ``error`` (it cannot go on) and give back what it holds."""
        log.warning("request %s failed: %s", req.request_id, error)
        self.abort(req.request_id)
        return RequestOutput(
            req.request_id, [], True, FinishReason.ABORT, error=error, error_type=error_type
        )

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[Picked]:
        """One token per row, and its logprobs where asked. A guided row's grammar masks
        what it forbids first (``grammar.mask_logits``). Rows are steered (bias,
        ``min_tokens``, penalties) only when some request asks for it: the plain path is
        the batched argmax/sampler on the model's logits as they come. Each stage that
        raises names itself (``isolation.stage``); ``per_row`` runs this batched, then
        row by row where it raised."""
        params = [r.params for r in requests]
        with stage("the structured-output grammar's mask", GRAMMAR_ERROR_TYPE):
            logits = mask_logits(logits, [r.grammar for r in requests])
        if any(p.steers for p in params):
            with stage("the logits processing (logit_bias, min_tokens, penalties)", FAILED):
                logits = process_logits(logits, params, requests, self._eos)
        _check_some_token_left(logits, requests)
        with stage("sampling", FAILED):
            tokens = sample(
                logits, params, [r.seed for r in requests], [r.num_tokens for r in requests]
            )
        if not any(p.logprobs is not None for p in params):
            return [(t, None) for t in tokens]
        with stage("the logprobs", FAILED):
            logprobs = token_logprobs(logits, tokens, params)
        return list(zip(tokens, logprobs, strict=True))

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        new: list[int],
        logprobs: list[TokenLogprobs] | None = None,
        prefill_time_s: float | None = None,
        queue_time_s: float | None = None,
    ) -> RequestOutput:
        self.scheduler.finish(req)
        req.finish_reason = reason
        if req.hold_kv:
            self.scheduler.cache_computed(req)
        else:
            self._release(req)
        return RequestOutput(
            req.request_id, new, True, reason, req.num_cached_tokens, logprobs=logprobs,
            prefill_time_s=prefill_time_s, queue_time_s=queue_time_s,
        )  # fmt: skip

    # --- cache and stats ----------------------------------------------------------------------
    def drain_cache_events(self) -> list[CacheEvent]:
        """Prefix-cache store/remove events since the last drain (for the router's index)."""
        return self.cache.drain_events()

    @property
    def num_dropped_cache_events(self) -> int:
        """Cache events lost to the bounded event buffer since start (subscribers must resync)."""
        return self.cache.num_dropped_events

    def reset_prefix_cache(self) -> int:
        """Evict every unlocked cached block; returns how many were freed."""
        return self.cache.evict(self.cache.evictable_blocks)

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` if block references disagree with their holders (every
        pool reference held by one live request's table entry or by the prefix cache)."""
        self.requests.check_integrity(self.pool, self.cache)

    @property
    def max_running_requests(self) -> int:
        """Requests decoded at once: the instance's capacity (``max_running_requests``, capped)."""
        return self.scheduler.config.max_running_requests

    def info(self) -> EngineInfo:
        """What this engine got: device, dtype, KV capacity and limits, as resolved."""
        return EngineInfo(
            device=str(self.device),
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            dtype_reason=self.dtype_reason,
            cpu_kernels=self.loaded.model.kernels.variant if self.loaded.model.kernels else None,
            block_size=self.config.block_size,
            kv_blocks=self.kv.num_blocks,
            kv_tokens=self.kv.num_blocks * self.config.block_size,
            kv_bytes=self.kv.num_blocks * self.layout.bytes_per_block,
            max_running_requests=self.max_running_requests,
            max_model_len=self.max_model_len,
            max_prompt_tokens=self.limits.max_prompt_tokens,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            kv_shape=KVShape(
                num_layers=self.layout.num_layers,
                num_kv_heads=self.layout.num_kv_heads,
                head_dim=self.layout.head_dim,
                dtype=str(self.layout.dtype).removeprefix("torch."),
                bytes_per_token=self.layout.bytes_per_token,
            ),
        )

    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            num_total_blocks=self.pool.num_total,
            num_free_blocks=self.pool.num_free,
            num_cached_blocks=self.cache.num_cached_blocks,
            num_locked_blocks=self.cache.protected_blocks,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_awaiting_kv=sum(r.status is RequestStatus.AWAITING_KV for r in self.requests),
            num_preemptions=self.scheduler.num_preemptions,
        )

    # --- handoff: both ends of PDD's KV and token-ID handoffs (``Handoff``) -------------
    def extend(self, request_id: str, token_ids: Sequence[int], hold: bool = False) -> None:
        """Append token IDs generated elsewhere (``Handoff.extend``)."""
        self.handoff.extend(request_id, token_ids, hold)

    def finished_elsewhere(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Compute the KV of an answer another instance ended (``Handoff.finished_elsewhere``)."""
        self.handoff.finished_elsewhere(request_id, token_ids)

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` the prefix cache holds now (nothing is locked)."""
        return self.handoff.cached_prefix_tokens(token_ids)

    def computed_tokens(self, request_id: str) -> int:
        """Tokens of a live request with KV now (``Handoff.computed_tokens``)."""
        return self.handoff.computed_tokens(request_id)

    def export_kv(
        self, request_id: str, start: int, end: int, chunk_tokens: int = 256,
        codec: KVCodec = NO_CODEC,
    ) -> Iterator[bytes]:  # fmt: skip
        """Chunks of a live request's KV of ``[start, end)`` (``Handoff.export_kv``)."""
        return self.handoff.export_kv(request_id, start, end, chunk_tokens, codec)

    def release(self, request_id: str) -> None:
        """Free a finished ``hold_kv`` request's blocks (``Handoff.release``)."""
        self.handoff.release(request_id)

    def attach_request(
        self,
        token_ids: Sequence[int],
        params: SamplingParams | None,
        request_id: str,
        use_cache: bool = True,
        private_kv: bool = False,
        samples_first: bool = False,
    ) -> int:
        """Receive a request whose KV comes from elsewhere (``Handoff.attach_request``)."""
        return self.handoff.attach_request(
            token_ids, params, request_id, use_cache, private_kv, samples_first
        )

    def import_kv(self, request_id: str, chunk: bytes, codec: KVCodec = NO_CODEC) -> int:
        """Import one KV chunk into an attached request (``Handoff.import_kv``)."""
        return self.handoff.import_kv(request_id, chunk, codec)

    def resume(self, request_id: str, pending_token_ids: Sequence[int], hold: bool = False) -> None:
        """Start decoding an attached request (``Handoff.resume``)."""
        self.handoff.resume(request_id, pending_token_ids, hold)

    @property
    def fingerprint(self) -> str:
        """The model fingerprint stamped on exported KV (dtype is checked separately)."""
        return self.model_config.fingerprint()

    # --- helpers ------------------------------------------------------------------------------
    @property
    def _eos(self) -> tuple[int, ...]:
        return self.loaded.tokenizer.eos_token_ids

    def _release(self, req: Request) -> None:
        self.requests.release(req)


def _check_some_token_left(logits: torch.Tensor, requests: list[Request]) -> None:
    """Raise, naming the request, where a guided or steered row forbids every token: the
    grammar (with ``min_tokens`` and the stop ids it masks) allows none, and a pick among
    ``-inf`` would be a token nothing allows. Plain rows are the model's own logits."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None or r.params.steers]
    if not rows:
        return
    left = torch.isfinite(logits[rows]).any(dim=-1).tolist()
    for row, any_left in zip(rows, left, strict=True):
        if any_left:
            continue
        req = requests[row]
        steering = "min_tokens, stop_token_ids, logit_bias and penalties"
        if req.grammar is None:
            what, error_type = f"the logits after {steering} allow", FAILED
        else:
            steered = f" (with {steering})" if req.params.steers else ""
            what, error_type = f"the structured-output grammar{steered} allows", GRAMMAR_ERROR_TYPE
        position = len(output_history(req.params, req))
        raise RequestFailedError(
            f"no token can follow at output position {position}: {what} none", error_type
        )


def _prefill_time(req: Request, now: float) -> float | None:
    """Seconds since ``req``'s prefill began, where the token sampled ``now`` is the first
    of its output here (a resumed or handed-over request's is not: it prefilled elsewhere)."""
    if req.output_ids or req.prefill_started_at is None:
        return None
    return now - req.prefill_started_at


def _queue_time(req: Request) -> float | None:
    """Seconds ``req`` waited from ``add_request`` to the step that first scheduled it (a
    preempted request's requeue is not counted again, as in vLLM); None when it was
    attached rather than queued."""
    if req.queued_at is None or req.prefill_started_at is None:
        return None
    return req.prefill_started_at - req.queued_at
