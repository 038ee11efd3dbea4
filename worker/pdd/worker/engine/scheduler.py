"""Continuous batching: which requests compute how many tokens this step, and their blocks.

Policy (vLLM v1 style, in one pass per step):

1. Running requests first, in admission order: decodes (1 token) before the
   next chunk of a chunked prefill or a whole extend, so a long prompt never
   stalls running decodes. Each is charged against the step's token budget;
   extends are never split (the handoff recomputes its tokens in ONE pass), so
   an extend may exceed the budget.
2. Then waiting requests, FCFS, while budget and ``max_running_requests`` allow: match
   the longest cached prefix (locked), allocate blocks for the first chunk.
3. Blocks come from the free pool, else by evicting unlocked prefix-cache
   leaves, else by preempting the most recently admitted running request not
   yet scheduled this step: its computed blocks go into the prefix cache and
   it is requeued at the head of the queue to be recomputed, so the pool
   being full delays work but never fails it.

A prefill chunk also ends at the request's ``chunk_break``, where it sets one (a
P-MD prefill, so the first KV MD lacks crosses after a short step).

A request owns one pool reference per entry of its block table (matched
prefix blocks are increfed too), so releasing a request is always: insert its
computed tokens into the cache, free its table, unlock its prefix.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdd.worker.engine.block_pool import BlockPool
from pdd.worker.engine.prefix_cache import PrefixCache
from pdd.worker.engine.request import NoFreeBlocksError, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    max_num_batched_tokens: int  # token budget per step: bounds prefill chunks
    max_running_requests: int  # requests admitted at once (decode batch size bound)


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed

    @property
    def completes(self) -> bool:
        """True when this pass reaches the end of the sequence (its last logits are meaningful)."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


def _cut(req: Request, n: int) -> int:
    """``n`` tokens of ``req`` this step, ending at its chunk break where that falls inside."""
    brk = req.chunk_break
    if brk is not None and req.num_computed < brk < req.num_computed + n:
        return brk - req.num_computed
    return n


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, cache: PrefixCache) -> None:
        self.config = config
        self.pool = pool
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # since start: a sign the KV pool is too small for the load

    # --- the step -----------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        decodes_first = sorted(self.running, key=lambda r: r.num_uncomputed != 1)  # stable
        for req in decodes_first:
            if req.status is not RequestStatus.RUNNING or req.num_uncomputed == 0:
                continue  # preempted as a victim earlier in this loop, or held and caught up
            n = req.num_uncomputed if req.unchunked else _cut(req, min(req.num_uncomputed, budget))
            if n == 0 or not self._grow_or_preempt(req, req.num_computed + n, scheduled):
                continue
            scheduled.append(ScheduledSeq(req, n))
            budget -= min(n, budget)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            # at least one token left to compute
            self._claim_prefix(req, req.token_range(0, req.num_tokens - 1))
            n = _cut(req, min(req.num_uncomputed, budget))
            if not self._grow(req, req.num_computed + n):
                self._release_blocks(req, cache_computed=False)
                break  # FCFS: the head waits until blocks free up
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledSeq(req, n))
            budget -= n
        return scheduled

    # --- request life -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def attach(self, req: Request, samples_first: bool = False) -> int:
        """Claim the cached prefix of ``req.prompt_ids`` and blocks for the rest; returns the hit.

        For a request whose KV will be imported: it holds its blocks but is not
        scheduled until :meth:`start`. ``samples_first``: it will compute its first token
        here, so the match stops short of the prompt's last token (as an admission's
        does). Raises ``NoFreeBlocksError`` when even preemption cannot make room (state
        unchanged).
        """
        ids = req.prompt_ids[:-1] if samples_first else req.prompt_ids
        hit = self._claim_prefix(req, ids)
        if not self._grow_or_preempt(req, len(req.prompt_ids)):
            self._release_blocks(req, cache_computed=False)
            raise NoFreeBlocksError(
                f"attaching {len(req.prompt_ids)} tokens needs "
                f"{-(-len(req.prompt_ids) // self.config.block_size)} KV blocks; "
                f"{self.pool.num_free} of {self.pool.num_total} free after evicting the prefix "
                "cache and preempting running requests; retry later"
            )
        req.status = RequestStatus.AWAITING_KV
        return hit

    def start(self, req: Request) -> None:
        """Move an attached request into the running batch (ahead of the admission queue)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish(self, req: Request) -> None:
        """Take ``req`` out of the queues; its blocks stay until :meth:`release`."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED

    def release(self, req: Request) -> None:
        """Give back everything ``req`` holds, caching its computed full blocks."""
        self._release_blocks(req, cache_computed=True)

    def cache_computed(self, req: Request) -> None:
        """Put ``req``'s computed full blocks in the prefix cache now, while it still holds
        them (a finished ``hold_kv`` request): a request for the same prefix that comes
        before the release (the next of ``n`` samples, the next turn) hits them. The
        release's own insert then finds them cached and adopts nothing twice."""
        full_blocks = req.num_computed // self.config.block_size
        if req.use_cache and not req.private_kv and full_blocks:
            computed = req.token_range(0, full_blocks * self.config.block_size)
            self.cache.insert(computed, req.block_table[:full_blocks])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(r.num_uncomputed for r in self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- blocks -------------------------------------------------------------------------------
    def _claim_prefix(self, req: Request, token_ids: list[int]) -> int:
        """Lock the longest cached prefix of ``token_ids``, adopt its blocks; return its length.

        A ``use_cache=False`` request matches nothing (the empty prefix).
        """
        match = self.cache.match_prefix(token_ids if req.use_cache else [])
        self.cache.lock(match.handle)
        self.pool.incref(match.blocks)
        req.prefix_handle = match.handle
        req.block_table = list(match.blocks)
        req.num_computed = req.num_cached_tokens = match.num_tokens
        return match.num_tokens

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Extend the block table to cover ``num_tokens``, evicting from the cache if needed."""
        needed = req.blocks_needed(num_tokens, self.config.block_size)
        if needed > self.pool.num_free:
            self.cache.evict(needed - self.pool.num_free)
        if needed > self.pool.num_free:
            return False
        after = req.block_table[-1] if req.block_table else None  # keep the run contiguous
        req.block_table.extend(self.pool.allocate(needed, after=after))
        return True

    def _grow_or_preempt(
        self, req: Request, num_tokens: int, scheduled: Sequence[ScheduledSeq] = ()
    ) -> bool:
        """:meth:`_grow`, preempting running requests from the tail (maybe ``req`` itself).

        Requests already ``scheduled`` this step are never victims.
        """
        if self._grow(req, num_tokens):
            return True  # the common case: no need to look at the other requests
        busy = {id(s.request) for s in scheduled}
        while not self._grow(req, num_tokens):
            victim = next((r for r in reversed(self.running) if id(r) not in busy), None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self.running.remove(req)
        self._release_blocks(req, cache_computed=True)
        req.status = RequestStatus.WAITING
        req.unchunked = False  # recomputed as a (chunkable) prefill of all its tokens
        self.waiting.appendleft(req)

    def _release_blocks(self, req: Request, cache_computed: bool) -> None:
        if cache_computed:
            self.cache_computed(req)
        self.pool.free(req.block_table)
        if req.prefix_handle is not None:
            self.cache.unlock(req.prefix_handle)
        req.block_table = []
        req.prefix_handle = None
        req.num_computed = 0
