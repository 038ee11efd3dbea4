"""The engine's live requests: made from checked input, found by id, and let go once.

The engine and its handoff API (``handoff``) share one table: a request added by
``Engine.add_request`` or ``Handoff.attach_request`` lives here until it is released
(its blocks back to the pool, its computed prefix cached where it may be).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator, Sequence
from typing import NoReturn

from pdd.worker.engine.block_pool import BlockPool
from pdd.worker.engine.grammar import GrammarCompiler
from pdd.worker.engine.radix_cache import RadixCache
from pdd.worker.engine.request import (
    InvalidRequestStateError,
    Request,
    RequestError,
    RequestLimits,
    UnknownRequestError,
)
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.engine.scheduler import Scheduler


class RequestTable:
    def __init__(
        self, limits: RequestLimits, grammars: GrammarCompiler, scheduler: Scheduler
    ) -> None:
        self.limits = limits
        self.grammars = grammars
        self._scheduler = scheduler
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()

    def new(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        hold_kv: bool,
    ) -> Request:
        """A request checked against the engine's limits (not yet in the table)."""
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

    def add(self, req: Request) -> None:
        self._requests[req.request_id] = req

    def get(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(
                f"no live request {request_id!r} (finished, aborted or never added)"
            )
        return req

    def release(self, req: Request) -> None:
        """Give back what ``req`` holds and forget it."""
        self._scheduler.release(req)
        del self._requests[req.request_id]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests.values())

    def check_integrity(self, pool: BlockPool, cache: RadixCache) -> None:
        """Raise ``RuntimeError`` if block references disagree with their holders.

        Every pool reference is held by exactly one live request's table entry or by
        the prefix cache; anything else is a leak (or a double free).
        """
        pool.check_integrity()
        cache.check_integrity()
        held = sum(len(r.block_table) for r in self)
        refs = sum(pool.refcount(b) for b in range(pool.num_total))
        if refs != held + cache.num_cached_blocks:
            raise RuntimeError(
                f"{refs} block references in the pool, but requests hold {held} and the prefix "
                f"cache {cache.num_cached_blocks}: blocks leaked or freed twice"
            )
        if any(r.prefix_handle is not None and not r.block_table for r in self):
            raise RuntimeError("a request holds a prefix lock but no blocks")


def state_error(req: Request, op: str, allowed: str) -> NoReturn:
    raise InvalidRequestStateError(
        f"cannot {op} request {req.request_id!r} while it is {req.status.value}: "
        f"{op} applies to {allowed}"
    )
