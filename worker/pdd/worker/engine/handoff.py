"""Both ends of PDD's KV and token-ID handoffs, over the engine's requests, scheduler,
prefix cache and KV pool: the engine owns one ``Handoff`` and delegates these calls to it.

A sender exports a request's KV (``hold_kv`` keeps it after the request finishes,
``release`` frees it once shipped, ``computed_tokens`` says how much a prefill has
written so far); a receiver attaches a request (reusing what its prefix cache holds),
imports the rest, and resumes it with the token IDs generated elsewhere, which are
recomputed in ONE extend pass before decoding continues. ``extend`` hands more token
IDs to a running request the same way (catch-up handoff); ``finished_elsewhere``
computes the KV of an answer another instance finished, for the cache. The KV wire
format is ``kv_transfer``. Single-threaded, as the engine is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pdd.common.kv_codec import NO_CODEC, KVCodec
from pdd.worker.engine.kv_transfer import KVRangeError, encode_chunk, import_chunk
from pdd.worker.engine.radix_cache import RadixCache
from pdd.worker.engine.request import (
    InvalidRequestStateError,
    Request,
    RequestError,
    RequestStatus,
)
from pdd.worker.engine.request_table import RequestTable, state_error
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.engine.scheduler import Scheduler
from pdd.worker.model.kv_cache import PagedKVCache


class Handoff:
    def __init__(
        self,
        requests: RequestTable,
        scheduler: Scheduler,
        cache: RadixCache,
        kv: PagedKVCache,
        fingerprint: str,
    ) -> None:
        self._requests = requests
        self._scheduler = scheduler
        self._cache = cache
        self._kv = kv
        #: The model fingerprint stamped on exported KV and checked on imported KV.
        self._fingerprint = fingerprint

    def extend(self, request_id: str, token_ids: Sequence[int], hold: bool = False) -> None:
        """Append token IDs generated elsewhere; the next step computes them in ONE pass.

        With ``hold`` the request then waits without sampling (catch-up handoff:
        more chunks follow); a later ``extend`` with ``hold=False`` resumes decoding.
        """
        req = self._requests.get(request_id)
        if req.status not in (RequestStatus.RUNNING, RequestStatus.WAITING):
            state_error(req, "extend", "running or waiting requests (attached: resume())")
        tokens = self._requests.limits.check_appended(req, token_ids)
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
        req = self._requests.get(request_id)
        if req.status is RequestStatus.AWAITING_KV:
            self.resume(request_id, token_ids, hold=True)
        else:
            self.extend(request_id, token_ids, hold=True)
        req.cache_only = True

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` the prefix cache holds now (nothing is locked)."""
        return self._cache.match_prefix(token_ids).num_tokens

    def computed_tokens(self, request_id: str) -> int:
        """Tokens of a live request whose KV is in the cache now: what ``export_kv`` can
        read. It grows chunk by chunk while a long prompt prefills (and falls back to 0
        if the request is preempted), so a prefill can ship its KV as it is written."""
        return self._requests.get(request_id).num_computed

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
        req = self._requests.get(request_id)
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
        req = self._requests.get(request_id)
        if req.status is not RequestStatus.FINISHED:
            state_error(req, "release", "finished (hold_kv) requests; use abort()")
        self._requests.release(req)

    def attach_request(
        self,
        token_ids: Sequence[int],
        params: SamplingParams | None,
        request_id: str,
        use_cache: bool = True,
        private_kv: bool = False,
        samples_first: bool = False,
    ) -> int:
        """Receive a request whose KV comes from elsewhere; returns the prefix hit in tokens.

        Locks the longest cached prefix of ``token_ids`` and allocates blocks for
        the rest; the KV of ``[hit, len(token_ids))`` is then expected through
        :meth:`import_kv` before :meth:`resume`. ``use_cache=False`` bypasses the
        prefix cache for this request only (no match, hit 0, nothing inserted when
        it ends): the naive pipeline ships the full KV without disturbing what the
        cache holds for others. ``private_kv`` matches the cache but inserts nothing
        (KV that crosses coded where the cache must hold exact KV). ``samples_first``:
        this instance computes the first token itself (:meth:`resume` with no pending
        tokens), so the match leaves at least the prompt's last token to compute. Raises
        ``RequestError`` subclasses (``NoFreeBlocksError`` when the pool cannot make
        room now).
        """
        req = self._requests.new(token_ids, params, request_id, hold_kv=False)
        req.use_cache = use_cache
        req.private_kv = private_kv
        hit = self._scheduler.attach(req, samples_first)
        self._requests.add(req)
        return hit

    def import_kv(self, request_id: str, chunk: bytes, codec: KVCodec = NO_CODEC) -> int:
        """Import one KV chunk into an attached request; returns the tokens now held.

        ``codec`` is the one the transfer's handshake agreed on. Raises a
        ``KVTransferError`` subclass (checksum, fingerprint, dtype, layout, codec,
        range, token mismatch) and changes nothing when the chunk does not fit.
        """
        req = self._requests.get(request_id)
        if req.status is not RequestStatus.AWAITING_KV:
            state_error(req, "import KV into", "attached requests")
        held = req.num_computed
        req.num_computed = import_chunk(
            self._kv, req.block_table, req.prompt_ids, held, chunk, self._fingerprint, codec
        )
        # Cached as it lands, not when the request ends: the conversation's next turn may
        # come while this one still waits for a relay's IDs, or decodes.
        self._scheduler.cache_computed(req)
        return req.num_computed

    def resume(self, request_id: str, pending_token_ids: Sequence[int], hold: bool = False) -> None:
        """Start decoding an attached request after the tokens generated elsewhere.

        ``pending_token_ids`` (at least the first token the prefill sampled, or none
        where the prompt's tail is still to compute: the request then prefills it here
        and samples its first token) are appended as output and computed, with any
        prompt tail whose KV did not arrive, in the next step; then it samples on
        (unless ``hold``, see :meth:`extend`). Handoffs join the running batch ahead of
        the queue.
        """
        req = self._requests.get(request_id)
        if req.status is not RequestStatus.AWAITING_KV:
            state_error(req, "resume", "attached requests")
        tokens = self._requests.limits.check_appended(req, pending_token_ids)
        if not tokens and req.num_computed == len(req.prompt_ids):
            raise RequestError("resume needs at least one pending token id (the first output)")
        req.unchunked = req.num_computed == len(req.prompt_ids)
        req.output_ids.extend(tokens)
        req.hold_sampling = hold
        self._scheduler.start(req)

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
            data = self._kv.read_tokens(req.block_table, a, b)
            yield encode_chunk(data, a, self._fingerprint, req.token_range(0, b), codec)
