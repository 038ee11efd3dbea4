"""The pdd engine's KV and handoff surface over vLLM, so P, RLD and MD run their own code on it.

The roles call on their engine what the pdd engine offers for PDD's moves; this maps
each onto a vLLM request and the PDD connector (``connector.py``), which runs in vLLM's
engine-core process and meets this worker process in a private ``DirectoryKVStore``
(``--engine vllm`` gives each worker its own folder). The chunks on both sides are the
pdd engine's (``token_kv.TokenKV``), so the roles' transfer, codec and handoff code is
the same on both engines:

- **P** (``add_request(hold_kv=True)``): the prompt runs with ``export_params``; the
  connector writes each step's KV into the store as exact chunks. ``computed_tokens``
  is what has landed there, ``export_kv`` reads any range of it in any codec for the
  line. The KV is held here, not in vLLM's blocks, until ``abort`` or ``release``.
- **RLD, MD** (``attach_request`` then ``import_kv``): the line's chunks are imported
  into this process (every check of ``import_chunk``: a gap is ``KVGapError`` as on the
  pdd engine). ``resume`` submits prompt + the handed-over IDs with ``import_params``
  naming one exact chunk of the held prompt: vLLM loads what its prefix cache lacks
  and computes only the handed-over IDs. ``extend`` with ``hold`` (catch-up) collects
  IDs; the final one submits them all in one pass. ``finished_elsewhere`` computes
  the KV of an answer another instance ended, for the prefix cache.

The hit a receiver answers (``attach_request``, ``cached_prefix_tokens``) is what vLLM's
KV events say its prefix cache holds (``cached_prefix``), not locked: where vLLM evicted
it meanwhile, the connector computes the request in full.

Not mapped (the pdd engine's alone): ``chunk_break`` (vLLM chunks its prefill itself),
``private_kv`` and ``use_cache=False`` beyond a hit of 0 (vLLM's prefix cache takes every
request).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.common.cache_events import CacheEvent
from pdd.common.kv_codec import NO_CODEC, KVCodec
from pdd.common.wire import EngineInfo
from pdd.worker.engine.request import (
    PromptTooLongError,
    RequestError,
    RequestOutput,
    UnknownRequestError,
    finish_reason_after,
)
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.kv_cache import KVLayout
from pdd.worker.vllm.cached_prefix import CachedPrefix
from pdd.worker.vllm.engine_args import VllmEngineSettings
from pdd.worker.vllm.params import export_params, import_params
from pdd.worker.vllm.sampling import check_handoff, check_supported
from pdd.worker.vllm.serving import KVUsage, VllmEngine, start_vllm
from pdd.worker.vllm.store import DirectoryKVStore
from pdd.worker.vllm.token_kv import TokenKV

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from pdd.worker.vllm.kv_events_feed import VllmKVEventFeed

log = logging.getLogger(__name__)


@dataclass
class _Export:
    """P's prompt: its store key and the KV landed so far."""

    key: str
    kv: TokenKV
    read: int = 0  # chunks of the store's stream taken into ``kv``


@dataclass
class _Attached:
    """A request whose KV comes over the line, and the IDs handed over since."""

    params: SamplingParams
    kv: TokenKV
    pending: list[int] = field(default_factory=list)


class VllmRoleEngine(VllmEngine):
    """``VllmEngine`` plus the KV moves of P, RLD and MD (see the module's docstring)."""

    def __init__(
        self,
        llm: AsyncLLM,
        info: EngineInfo,
        usage: KVUsage,
        sampling: Callable[[dict[str, Any]], Any],
        store: DirectoryKVStore,
        layout: KVLayout,
        fingerprint: str,
        eos_token_ids: Sequence[int],
        cache_events: VllmKVEventFeed | None = None,
        router_block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        """``cache_events`` (vLLM's KV events, in the router's blocks of
        ``router_block_size``) also tell this engine what vLLM caches: the hit a receiver
        answers; without them it answers 0."""
        super().__init__(llm, info, usage, sampling, cache_events)
        self._cached = CachedPrefix(router_block_size, info.block_size)
        self._unread: list[CacheEvent] = []  # seen here, not yet drained by the router
        self._store = store
        self.fingerprint = fingerprint
        self._eos = frozenset(eos_token_ids)
        self.layout = layout
        #: What the roles read of the pdd engine's configuration.
        self.config = SimpleNamespace(
            block_size=info.block_size, max_num_batched_tokens=info.max_num_batched_tokens
        )
        self._exports: dict[str, _Export] = {}
        self._attached: dict[str, _Attached] = {}

    # ---- P ----

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        hold_kv: bool = False,
        chunk_break: int | None = None,
    ) -> None:
        """Admit a request; with ``hold_kv`` its prompt's KV is exported and held here
        until ``release`` or ``abort`` (``chunk_break`` is the pdd engine's: ignored)."""
        if not hold_kv:
            super().add_request(prompt_ids, params, request_id)
            return
        self._check_length(prompt_ids)
        check_handoff(params)  # RLD or MD resume it after P's token
        if request_id in self._exports or request_id in self._tasks:
            raise ValueError(f"request {request_id!r} is already running here")
        key = _store_key("out", request_id)
        self._store.drop(key)
        export = _Export(key, TokenKV(self.layout, self.fingerprint, prompt_ids))
        self._submit(request_id, list(prompt_ids), params, export_params(key))
        self._exports[request_id] = export

    def computed_tokens(self, request_id: str) -> int:
        """Prompt tokens whose KV vLLM has computed and the connector delivered."""
        return self._landed(request_id).kv.held

    def export_kv(
        self, request_id: str, start: int, end: int, chunk_tokens: int = 256,
        codec: KVCodec = NO_CODEC,
    ) -> Iterator[bytes]:  # fmt: skip
        """Chunks of the held prompt KV of ``[start, end)``, coded by ``codec``."""
        return self._landed(request_id).kv.chunks(start, end, chunk_tokens, codec)

    def release(self, request_id: str) -> None:
        """Let go of a finished ``hold_kv`` request's KV."""
        export = self._exports.pop(request_id, None)
        if export is None:
            raise UnknownRequestError(request_id)
        self._store.drop(export.key)

    def _landed(self, request_id: str) -> _Export:
        """The export with every chunk the connector has written so far taken in."""
        export = self._exports.get(request_id)
        if export is None:
            raise UnknownRequestError(request_id)
        for chunk in self._store.chunks(export.key, skip=export.read):
            export.kv.take(chunk)
            export.read += 1
        return export

    # ---- RLD and MD ----

    def attach_request(
        self, token_ids: Sequence[int], params: SamplingParams | None, request_id: str,
        use_cache: bool = True, private_kv: bool = False, samples_first: bool = False,
    ) -> int:  # fmt: skip
        """Take a request whose prompt KV comes over the line; returns the prefix held
        here (0: see the module's docstring). Sampling vLLM cannot do is refused now."""
        if request_id in self._attached or request_id in self._tasks:
            raise RequestError(f"request {request_id!r} is already attached here")
        params = params or SamplingParams()
        (check_supported if samples_first else check_handoff)(params)
        self._check_length(token_ids)
        hit = min(self.cached_prefix_tokens(token_ids), len(token_ids) - 1) if use_cache else 0
        kv = TokenKV(self.layout, self.fingerprint, token_ids, held=max(0, hit))
        self._attached[request_id] = _Attached(params, kv)
        return kv.start

    def import_kv(self, request_id: str, chunk: bytes, codec: KVCodec = NO_CODEC) -> int:
        """Import one chunk of an attached request; returns the tokens held."""
        return self._attachment(request_id).kv.take(chunk, codec)

    def resume(self, request_id: str, pending_token_ids: Sequence[int], hold: bool = False) -> None:
        """Decode on after the IDs generated elsewhere (none: prefill the prompt's tail
        and sample the first token); with ``hold`` only collect them (``extend``)."""
        attached = self._attachment(request_id)
        attached.pending.extend(pending_token_ids)
        if not hold:
            self._start(request_id, attached)

    def extend(self, request_id: str, token_ids: Sequence[int], hold: bool = False) -> None:
        """More IDs generated elsewhere; the last (not ``hold``) starts the decode."""
        self.resume(request_id, token_ids, hold)

    def finished_elsewhere(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Compute the KV of an answer another instance ended, so the prefix cache holds
        the conversation; the one output, finished, says it is done."""
        attached = self._attachment(request_id)
        attached.pending.extend(token_ids)
        del self._attached[request_id]
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        self._submit_with_kv(request_id, attached, params)

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` vLLM's prefix cache holds, as its KV events say
        (``cached_prefix``: whole router blocks; nothing locked)."""
        self._read_events()
        return self._cached.tokens(token_ids)

    def drain_cache_events(self) -> list[CacheEvent]:
        """The router's cache events since its last poll (read here first, too)."""
        self._read_events()
        events, self._unread = self._unread, []
        return events

    def _read_events(self) -> None:
        events = super().drain_cache_events()
        self._cached.seen(events)
        self._unread.extend(events)

    def _start(self, request_id: str, attached: _Attached) -> None:
        """Submit the attached request, or end it where the handed-over IDs already do."""
        del self._attached[request_id]
        pending, params = attached.pending, attached.params
        ended = finish_reason_after(
            pending, params, self._eos, len(attached.kv.token_ids) + len(pending),
            self._info.max_model_len,
        ) if pending else None  # fmt: skip
        if ended is not None:
            done = RequestOutput(request_id, [], True, ended)
            asyncio.get_running_loop().call_soon(self.deliver, [done])
            return
        if pending:  # vLLM counts what it samples itself: the handed IDs are prompt to it
            params = params.with_changes(
                max_tokens=params.max_tokens - len(pending),
                prior_output_tokens=params.prior_output_tokens + len(pending),
            )
        self._submit_with_kv(request_id, attached, params)

    def _submit_with_kv(self, request_id: str, attached: _Attached, params: SamplingParams) -> None:
        """Run prompt + pending IDs, the held prompt KV handed to the connector."""
        kv = attached.kv
        prompt = [*kv.token_ids, *attached.pending]
        self._check_length(prompt)
        transfer = None
        held = min(kv.held, len(prompt) - 1)
        if held > kv.start:  # what came over the line, past the hit vLLM's cache gives
            key = _store_key("in", request_id)
            self._store.drop(key)
            self._store.put(key, next(kv.chunks(kv.start, held, held)))
            transfer = import_params(key, held, start=kv.start)
        self._submit(request_id, prompt, params, transfer)

    def _attachment(self, request_id: str) -> _Attached:
        attached = self._attached.get(request_id)
        if attached is None:
            raise UnknownRequestError(request_id)
        return attached

    # ---- both ----

    def abort(self, request_id: str) -> None:
        """Stop the request wherever it is and let go of any KV held for it."""
        export = self._exports.pop(request_id, None)
        if export is not None:
            self._store.drop(export.key)
        attached = self._attached.pop(request_id, None)
        try:
            super().abort(request_id)
        except UnknownRequestError:
            if export is None and attached is None:
                raise

    def shutdown(self) -> None:
        """Remove the store this process shared with vLLM, then stop vLLM: first, as
        vLLM's stop can outlast the time a supervisor gives the worker (seen twice: P's
        store left behind when its engine core was slow to exit under ``pdd up``)."""
        shutil.rmtree(self._store.root, ignore_errors=True)
        super().shutdown()

    def _started(self, rid: str, prompt_tokens: int, cached_tokens: int) -> None:
        """Say what vLLM computed of a request: after a handoff, only the handed-over IDs
        (and what the line did not bring)."""
        log.info(
            "vLLM request %s: computed %d of %d prompt tokens (%d loaded or cached)",
            rid, prompt_tokens - cached_tokens, prompt_tokens, cached_tokens,
        )  # fmt: skip

    def _ended(self, rid: str) -> None:
        self._store.drop(_store_key("in", rid))

    def _check_length(self, token_ids: Sequence[int]) -> None:
        if len(token_ids) > self._info.max_prompt_tokens:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; this instance takes at most "
                f"{self._info.max_prompt_tokens}"
            )


def _store_key(direction: str, request_id: str) -> str:
    """A store key for ``request_id``'s KV in one direction (any request ID fits)."""
    return f"{direction}-{hashlib.sha256(request_id.encode()).hexdigest()[:32]}"


def start_role_engine(settings: VllmEngineSettings, router_block_size: int) -> VllmRoleEngine:
    """``serving.start_vllm`` with the connector over ``settings.kv_store_dir``, wrapped
    for P, RLD and MD."""
    from pdd.worker.vllm.connector import model_fingerprint  # needs vLLM: imported late

    if settings.kv_store_dir is None:
        raise ValueError("P, RLD and MD on vLLM need kv_store_dir: the connector's store")
    started = start_vllm(settings, router_block_size)
    config = started.llm.vllm_config
    return VllmRoleEngine(
        started.llm, started.info, started.usage, started.sampling,
        DirectoryKVStore(settings.kv_store_dir), kv_layout(config), model_fingerprint(config),
        eos_token_ids(config), started.cache_events, router_block_size,
    )  # fmt: skip


def kv_layout(config: Any) -> KVLayout:
    """vLLM's KV as PDD's per-token layout (the roles size their transfers by it)."""
    model, cache = config.model_config, config.cache_config
    parallel = config.parallel_config
    return KVLayout(
        model.get_num_layers(parallel), model.get_num_kv_heads(parallel),
        model.get_head_size(), int(cache.block_size), model.dtype,
    )  # fmt: skip


def eos_token_ids(config: Any) -> list[int]:
    """The IDs that end a request unless it ignores EOS: the model's and its generation
    config's (as vLLM stops on them)."""
    found: list[int] = []
    sources = [config.model_config.hf_config.to_dict()]
    sources.append(config.model_config.try_get_generation_config() or {})
    for source in sources:
        eos = source.get("eos_token_id")
        found.extend([eos] if isinstance(eos, int) else list(eos or []))
    return sorted(set(found))
