"""Both ends of PDD's handoffs, as the engine's handoff methods (wire format in ``kv_transfer.py``).

A sender exports a request's KV (``hold_kv`` keeps it after the request
finishes, ``release`` frees it once shipped); a receiver attaches a request
(reusing what its prefix cache holds), imports the rest, and resumes it with
the token IDs generated elsewhere, which are recomputed in ONE extend pass
before decoding continues. ``extend`` hands more token IDs to a running
request the same way (catch-up handoff: ``hold=True`` computes them without
sampling yet).

``HandoffMixin`` is mixed into ``Engine``; it only touches request state and
the scheduler, never the forward pass, so the step loop stays in ``engine.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from pdd.worker.kv_transfer import KVRangeError, encode_chunk, import_chunk
from pdd.worker.request import (
    InvalidRequestStateError,
    Request,
    RequestError,
    RequestStatus,
)
from pdd.worker.sampling import SamplingParams

if TYPE_CHECKING:
    from pdd.worker.engine import Engine


class HandoffMixin:
    """extend / export_kv / attach_request / import_kv / resume / release for ``Engine``."""

    def extend(self: Engine, request_id: str, token_ids: Sequence[int], hold: bool = False) -> None:
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

    def export_kv(
        self: Engine, request_id: str, start: int, end: int, chunk_tokens: int = 256
    ) -> Iterator[bytes]:
        """Chunks of the KV of tokens ``[start, end)`` of a live request, read lazily.

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
        return self._export_chunks(req, start, end, chunk_tokens)

    def release(self: Engine, request_id: str) -> None:
        """Free a finished ``hold_kv`` request's blocks (its computed blocks stay cached)."""
        req = self._get(request_id)
        if req.status is not RequestStatus.FINISHED:
            self._state_error(req, "release", "finished (hold_kv) requests; use abort()")
        self._release(req)

    def attach_request(
        self: Engine,
        token_ids: Sequence[int],
        params: SamplingParams | None,
        request_id: str,
        use_cache: bool = True,
    ) -> int:
        """Receive a request whose KV comes from elsewhere; returns the prefix hit in tokens.

        Locks the longest cached prefix of ``token_ids`` and allocates blocks for
        the rest; the KV of ``[hit, len(token_ids))`` is then expected through
        :meth:`import_kv` before :meth:`resume`. ``use_cache=False`` bypasses the
        prefix cache for this request only (no match, hit 0, nothing inserted when
        it ends): the naive pipeline ships the full KV without disturbing what the
        cache holds for others. Raises ``RequestError`` subclasses
        (``NoFreeBlocksError`` when the pool cannot make room now).
        """
        req = self._new_request(token_ids, params, request_id, hold_kv=False)
        req.use_cache = use_cache
        hit = self.scheduler.attach(req)
        self._requests[req.request_id] = req
        return hit

    def import_kv(self: Engine, request_id: str, chunk: bytes) -> int:
        """Import one KV chunk into an attached request; returns the tokens now held.

        Raises a ``KVTransferError`` subclass (checksum, fingerprint, dtype,
        layout, range, token mismatch) and changes nothing when the chunk does not fit.
        """
        req = self._get(request_id)
        if req.status is not RequestStatus.AWAITING_KV:
            self._state_error(req, "import KV into", "attached requests")
        req.num_computed = import_chunk(
            self.kv, req.block_table, req.prompt_ids, req.num_computed, chunk, self.fingerprint
        )
        return req.num_computed

    def resume(
        self: Engine, request_id: str, pending_token_ids: Sequence[int], hold: bool = False
    ) -> None:
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
    def fingerprint(self: Engine) -> str:
        """The model fingerprint stamped on exported KV (dtype is checked separately)."""
        return self.model_config.fingerprint()

    def _export_chunks(
        self: Engine, req: Request, start: int, end: int, chunk_tokens: int
    ) -> Iterator[bytes]:
        for a in range(start, end, chunk_tokens):
            b = min(a + chunk_tokens, end)
            if req.num_computed < b:
                raise InvalidRequestStateError(
                    f"request {req.request_id!r} lost its KV during export (released or "
                    "preempted); export again"
                )
            data = self.kv.read_tokens(req.block_table, a, b)
            yield encode_chunk(data, a, self.fingerprint, req.token_range(0, b))
