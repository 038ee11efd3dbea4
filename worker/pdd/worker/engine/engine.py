"""The inference engine: continuous batching over a paged, prefix-cached KV pool.

``step()`` is the whole story: the scheduler picks who computes how many tokens
(decodes, prefill chunks, extends), one batched forward pass computes them, and
requests whose pass reached the end of their sequence sample their next token.

The handoff methods are here too, so the whole API is one class: a sender exports a
request's KV (``hold_kv`` keeps it after the request finishes, ``release`` frees it
once shipped); a receiver attaches a request (reusing what its prefix cache holds),
imports the rest, and resumes it with the token IDs generated elsewhere, which are
recomputed in ONE extend pass before decoding continues. ``extend`` hands more token
IDs to a running request the same way (catch-up handoff). The KV wire format is
``kv_transfer``; options and stats are ``config``. See docs/engine.md.

Everything here is single-threaded: call it from one thread (the worker's
event loop runs it in an executor).
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from pdd.common.cache_events import CacheEvent
from pdd.common.kv_codec import NO_CODEC, KVCodec
from pdd.common.tokenizer import Tokenizer
from pdd.common.wire import EngineInfo, KVShape, TokenLogprobs
from pdd.worker.engine.block_pool import BlockPool
from pdd.worker.engine.config import (
    DEFAULT_CPU_KV_BYTES,
    DEFAULT_CUDA_KV_FRACTION,
    EngineConfig,
    EngineConfigError,
    EngineStats,
)
from pdd.worker.engine.device import (
    SYSTEM_PROBE,
    DeviceProbe,
    kv_budget_bytes,
    resolve_device,
    resolve_dtype,
)
from pdd.worker.engine.grammar import GrammarCompiler, GrammarStateError, mask_logits
from pdd.worker.engine.kv_transfer import KVRangeError, encode_chunk, import_chunk
from pdd.worker.engine.radix_cache import RadixCache
from pdd.worker.engine.request import (
    FinishReason,
    InvalidRequestStateError,
    NoFreeBlocksError,
    Request,
    RequestError,
    RequestLimits,
    RequestOutput,
    RequestStatus,
    UnknownRequestError,
)
from pdd.worker.engine.sampling import SamplingParams, process_logits, sample, token_logprobs
from pdd.worker.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import KVLayout, PagedKVCache
from pdd.worker.model.loader import LoadedModel, load_model

GIB = 2**30

log = logging.getLogger(__name__)


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
            self.loaded = model
            self.dtype_reason = "as loaded by the caller"
        else:
            device = resolve_device(config.device, probe)
            dtype = resolve_dtype(config.dtype, device, probe)
            if dtype.warning:
                log.warning("%s", dtype.warning)
            self.loaded = load_model(model, dtype=dtype.name, device=device)
            self.dtype_reason = dtype.reason
        self.model_config = self.loaded.config
        self.device = torch.device(self.loaded.device)
        self.layout = KVLayout.from_config(self.model_config, config.block_size, self.loaded.dtype)
        num_blocks = config.num_blocks or self._blocks_for_budget(probe)
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
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.grammars = GrammarCompiler(self.loaded.tokenizer, self.model_config.vocab_size)

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
    ) -> str:
        """Queue a request; returns its id. Raises a ``RequestError`` (state unchanged).

        ``hold_kv`` keeps the request's blocks after it finishes, so its KV can be
        exported (a prefill instance's job); call :meth:`release` afterwards.
        """
        req = self._new_request(prompt_ids, params, request_id, hold_kv)
        self.scheduler.add(req)
        self._requests[req.request_id] = req
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and give back everything it holds (any state)."""
        req = self._get(request_id)
        self.scheduler.finish(req)
        req.finish_reason = req.finish_reason or FinishReason.ABORT
        self._release(req)

    def fail_scheduled(self, error: str) -> list[RequestOutput]:
        """Abort every queued or running request after a failed step; one output each.

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
        logits = self._forward(scheduled)
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

    def _forward(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Last-token logits ``[len(scheduled), vocab]``, in ``scheduled`` order.

        Through the paged CPU kernel the whole step is one batch (no padding: each
        query token attends over its own sequence), so the weights are read once a
        step. Through SDPA, decodes and multi-token passes (prefill chunks, extends)
        run as two batches: attention pads every query to the longest in its batch,
        so one 512-token chunk beside 31 decodes would otherwise cost 32 x 512 queries.
        """
        decodes = [i for i, s in enumerate(scheduled) if s.num_tokens == 1]
        others = [i for i, s in enumerate(scheduled) if s.num_tokens > 1]
        if not decodes or not others or self._paged():
            return self._run([self._seq_input(s) for s in scheduled])
        short = self._run([self._seq_input(scheduled[i]) for i in decodes])
        long = self._run([self._seq_input(scheduled[i]) for i in others])
        logits = short.new_empty((len(scheduled), short.shape[1]))
        logits[decodes] = short
        logits[others] = long
        return logits

    def _run(self, seqs: list[SeqInput]) -> torch.Tensor:
        batch = ForwardBatch.build(seqs, self.config.block_size, self.device, paged=self._paged())
        return self.loaded.model(batch, self.kv)

    def _paged(self) -> bool:
        """Whether this step's batches are built for the paged CPU attention kernel."""
        kernels = self.loaded.model.kernels
        return kernels is not None and kernels.paged_attention is not None

    @staticmethod
    def _seq_input(s: ScheduledSeq) -> SeqInput:
        start = s.request.num_computed
        return SeqInput(
            token_ids=s.request.token_range(start, start + s.num_tokens),
            start_pos=start,
            block_table=s.request.block_table,
        )

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
                if req.grammar is not None:  # catch up on handed-over tokens before the pick
                    req.grammar.advance(req.output_ids)
            except GrammarStateError as e:
                outputs.append(self._fail(req, str(e)))
                continue
            reason = req.stop_reason(self._eos, self.max_model_len) if req.output_ids else None
            if reason is not None:  # handed-over tokens already ended it
                outputs.append(self._finish(req, reason, []))
            else:
                rows.append(row)
        sampling = [scheduled[r].request for r in rows]
        tokens, logprobs = self._sample(logits[rows], sampling)
        for req, token, lp in zip(sampling, tokens, logprobs, strict=True):
            req.output_ids.append(token)
            if req.grammar is not None:
                req.grammar.advance(req.output_ids)  # the mask allowed it: cannot fail
            reason = req.stop_reason(self._eos, self.max_model_len)
            lps = None if lp is None else [lp]
            if reason is None:
                outputs.append(
                    RequestOutput(
                        req.request_id, [token], False, None, req.num_cached_tokens, logprobs=lps
                    )
                )
            else:
                outputs.append(self._finish(req, reason, [token], lps))
        return outputs

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """End ``req`` with ``error`` (it cannot go on) and give back what it holds."""
        self.abort(req.request_id)
        return RequestOutput(req.request_id, [], True, FinishReason.ABORT, error=error)

    def _sample(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row, and its logprobs where asked. A guided row's grammar masks
        what it forbids first (``grammar.mask_logits``). Rows are steered (bias,
        ``min_tokens``, penalties) only when some request asks for it: the plain path is
        the batched argmax/sampler on the model's logits as they come."""
        params = [r.params for r in requests]
        logits = mask_logits(logits, [r.grammar for r in requests])
        if any(p.steers for p in params):
            logits = process_logits(logits, params, requests, self._eos)
        tokens = sample(
            logits, params, [r.seed for r in requests], [r.num_tokens for r in requests]
        )
        if any(p.logprobs is not None for p in params):
            return tokens, token_logprobs(logits, tokens, params)
        return tokens, [None] * len(tokens)

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        new: list[int],
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        self.scheduler.finish(req)
        req.finish_reason = reason
        if req.hold_kv:
            self.scheduler.cache_computed(req)
        else:
            self._release(req)
        return RequestOutput(
            req.request_id, new, True, reason, req.num_cached_tokens, logprobs=logprobs
        )

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
        """Raise ``RuntimeError`` if block references disagree with their holders.

        Every pool reference is held by exactly one live request table entry
        or by the prefix cache; anything else is a leak (or a double free).
        """
        self.pool.check_integrity()
        self.cache.check_integrity()
        held = sum(len(r.block_table) for r in self._requests.values())
        refs = sum(self.pool.refcount(b) for b in range(self.pool.num_total))
        if refs != held + self.cache.num_cached_blocks:
            raise RuntimeError(
                f"{refs} block references in the pool, but requests hold {held} and the prefix "
                f"cache {self.cache.num_cached_blocks}: blocks leaked or freed twice"
            )
        if any(r.prefix_handle is not None and not r.block_table for r in self._requests.values()):
            raise RuntimeError("a request holds a prefix lock but no blocks")

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
            num_awaiting_kv=sum(
                r.status is RequestStatus.AWAITING_KV for r in self._requests.values()
            ),
            num_preemptions=self.scheduler.num_preemptions,
        )

    # --- handoff: both ends of PDD's KV and token-ID handoffs ----------------------------

    def extend(self, request_id: str, token_ids: Sequence[int], hold: bool = False) -> None:
        """Append token IDs generated elsewhere; the next step computes them in ONE pass.

        With ``hold`` the request then waits without sampling (catch-up handoff:
        more chunks follow); a later ``extend`` with ``hold=False`` resumes decoding.
        """
        req = self._get(request_id)
        if req.status not in (RequestStatus.RUNNING, RequestStatus.WAITING):
            self._state_error(req, "extend", "running or waiting requests (attached: resume())")
        tokens = self.limits.check_appended(req, token_ids)
        req.output_ids.extend(tokens)
        if req.num_uncomputed == 0:  # held and caught up: recompute the last token for logits
            req.num_computed -= 1
        req.unchunked = req.status is RequestStatus.RUNNING
        req.hold_sampling = hold

    def finished_elsewhere(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Another instance ended the request (a relay ran it to the end): compute the KV
        of the output ``token_ids`` not yet handed over in the next step, sample nothing,
        and release it.

        The release caches the whole conversation, prompt and answer, so the next turn
        misses only what is new. Without it, each answer a relay finished would cross the
        WAN again with the turn after it, and those bigger transfers make the router relay
        more.
        """
        req = self._get(request_id)
        if req.status is RequestStatus.AWAITING_KV:
            self.resume(request_id, token_ids, hold=True)
        else:
            self.extend(request_id, token_ids, hold=True)
        req.cache_only = True

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` the prefix cache holds now (nothing is locked)."""
        return self.cache.match_prefix(token_ids).num_tokens

    def computed_tokens(self, request_id: str) -> int:
        """Tokens of a live request whose KV is in the cache now: what ``export_kv`` can
        read. It grows chunk by chunk while a long prompt prefills (and falls back to 0
        if the request is preempted), so a prefill can ship its KV as it is written."""
        return self._get(request_id).num_computed

    def export_kv(
        self, request_id: str, start: int, end: int, chunk_tokens: int = 256,
        codec: KVCodec = NO_CODEC,
    ) -> Iterator[bytes]:  # fmt: skip
        """Chunks of the KV of tokens ``[start, end)`` of a live request, read lazily,
        compressed by ``codec`` (the WAN's; the fast path ships it exact).

        Works on running, attached and finished ``hold_kv`` requests. The
        request must keep its KV while the iterator runs (a released or
        preempted request makes the next chunk raise ``InvalidRequestStateError``).
        """
        req = self._get(request_id)
        if not 0 <= start < end <= req.num_computed:
            raise KVRangeError(
                f"cannot export [{start}, {end}) of request {request_id!r}: it holds KV for "
                f"[0, {req.num_computed})"
            )
        if chunk_tokens < 1:
            raise KVRangeError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        return self._export_chunks(req, start, end, chunk_tokens, codec)

    def release(self, request_id: str) -> None:
        """Free a finished ``hold_kv`` request's blocks (its computed blocks stay cached)."""
        req = self._get(request_id)
        if req.status is not RequestStatus.FINISHED:
            self._state_error(req, "release", "finished (hold_kv) requests; use abort()")
        self._release(req)

    def attach_request(
        self,
        token_ids: Sequence[int],
        params: SamplingParams | None,
        request_id: str,
        use_cache: bool = True,
        private_kv: bool = False,
    ) -> int:
        """Receive a request whose KV comes from elsewhere; returns the prefix hit in tokens.

        Locks the longest cached prefix of ``token_ids`` and allocates blocks for
        the rest; the KV of ``[hit, len(token_ids))`` is then expected through
        :meth:`import_kv` before :meth:`resume`. ``use_cache=False`` bypasses the
        prefix cache for this request only (no match, hit 0, nothing inserted when
        it ends): the naive pipeline ships the full KV without disturbing what the
        cache holds for others. ``private_kv`` matches the cache but inserts nothing
        (KV that crosses coded where the cache must hold exact KV). Raises
        ``RequestError`` subclasses (``NoFreeBlocksError`` when the pool cannot make
        room now).
        """
        req = self._new_request(token_ids, params, request_id, hold_kv=False)
        req.use_cache = use_cache
        req.private_kv = private_kv
        hit = self.scheduler.attach(req)
        self._requests[req.request_id] = req
        return hit

    def import_kv(self, request_id: str, chunk: bytes, codec: KVCodec = NO_CODEC) -> int:
        """Import one KV chunk into an attached request; returns the tokens now held.

        ``codec`` is the one the transfer's handshake agreed on. Raises a
        ``KVTransferError`` subclass (checksum, fingerprint, dtype, layout, codec,
        range, token mismatch) and changes nothing when the chunk does not fit.
        """
        req = self._get(request_id)
        if req.status is not RequestStatus.AWAITING_KV:
            self._state_error(req, "import KV into", "attached requests")
        held = req.num_computed
        req.num_computed = import_chunk(
            self.kv, req.block_table, req.prompt_ids, held, chunk, self.fingerprint, codec
        )
        # Cached as it lands, not when the request ends: the conversation's next turn may
        # come while this one still waits for a relay's IDs, or decodes.
        self.scheduler.cache_computed(req)
        return req.num_computed

    def resume(self, request_id: str, pending_token_ids: Sequence[int], hold: bool = False) -> None:
        """Start decoding an attached request after the tokens generated elsewhere.

        ``pending_token_ids`` (at least the first token the prefill sampled) are
        appended as output and computed, with any prompt tail whose KV did not
        arrive, in the next step; then it samples on (unless ``hold``, see
        :meth:`extend`). Handoffs join the running batch ahead of the queue.
        """
        req = self._get(request_id)
        if req.status is not RequestStatus.AWAITING_KV:
            self._state_error(req, "resume", "attached requests")
        tokens = self.limits.check_appended(req, pending_token_ids)
        if not tokens and req.num_computed == len(req.prompt_ids):
            raise RequestError("resume needs at least one pending token id (the first output)")
        req.unchunked = req.num_computed == len(req.prompt_ids)
        req.output_ids.extend(tokens)
        req.hold_sampling = hold
        self.scheduler.start(req)

    @property
    def fingerprint(self) -> str:
        """The model fingerprint stamped on exported KV (dtype is checked separately)."""
        return self.model_config.fingerprint()

    def _export_chunks(
        self, req: Request, start: int, end: int, chunk_tokens: int, codec: KVCodec
    ) -> Iterator[bytes]:
        for a in range(start, end, chunk_tokens):
            b = min(a + chunk_tokens, end)
            if req.num_computed < b:
                raise InvalidRequestStateError(
                    f"request {req.request_id!r} lost its KV during export (released or "
                    "preempted); export again"
                )
            data = self.kv.read_tokens(req.block_table, a, b)
            yield encode_chunk(data, a, self.fingerprint, req.token_range(0, b), codec)

    # --- helpers ------------------------------------------------------------------------------
    def _blocks_for_budget(self, probe: DeviceProbe) -> int:
        """KV blocks for the budget; a budget this device cannot hold, or one below a
        block, is a setting to change (EngineConfigError), not an out-of-memory crash."""
        budget = self._kv_budget(probe)
        if self.config.kv_cache_memory_fraction is None:
            free = probe.free_memory_bytes(self.device)
            if budget > free:
                raise EngineConfigError(
                    f"a KV cache of {budget / GIB:.2f} GiB was asked for, but {self.device} has "
                    f"{free / GIB:.2f} GiB free after the weights; lower kvCacheGiB (or "
                    "--kv-cache-gib), or give kvCacheMemoryFraction instead"
                )
        try:
            return PagedKVCache.blocks_for_budget(self.layout, budget)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from None

    def _kv_budget(self, probe: DeviceProbe) -> int:
        """Bytes for the KV pool (see ``EngineConfig``); call it once the weights are in."""
        fraction = self.config.kv_cache_memory_fraction
        if fraction is None and self.config.kv_budget_bytes is not None:
            return self.config.kv_budget_bytes
        if fraction is None and self.device.type == "cpu":
            return DEFAULT_CPU_KV_BYTES
        return kv_budget_bytes(fraction or DEFAULT_CUDA_KV_FRACTION, self.device, probe)

    @property
    def _eos(self) -> tuple[int, ...]:
        return self.loaded.tokenizer.eos_token_ids

    def _new_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        hold_kv: bool,
    ) -> Request:
        params = params or SamplingParams()
        prompt = self.limits.check_prompt(prompt_ids, params.max_tokens)
        self.limits.check_params(params)
        if request_id is not None and request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use; pick a unique id")
        prior = params.prior_output_tokens
        if prior >= len(prompt):
            raise RequestError(
                f"prior_output_tokens ({prior}) must be less than the prompt's {len(prompt)} "
                "tokens: they are the prompt's last tokens, after the request's own prompt"
            )
        grammar = None
        if params.guided is not None:  # a resumed request's grammar goes on after its output
            grammar = self.grammars.start(params.guided, prompt[len(prompt) - prior :])
        return Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_ids=prompt,
            params=params,
            seed=params.seed if params.seed is not None else secrets.randbits(63),
            hold_kv=hold_kv,
            grammar=grammar,
        )

    def _get(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(
                f"no live request {request_id!r} (finished, aborted or never added)"
            )
        return req

    def _release(self, req: Request) -> None:
        self.scheduler.release(req)
        del self._requests[req.request_id]

    def _state_error(self, req: Request, op: str, allowed: str) -> None:
        raise InvalidRequestStateError(
            f"cannot {op} request {req.request_id!r} while it is {req.status.value}: "
            f"{op} applies to {allowed}"
        )
