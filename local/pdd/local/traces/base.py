"""What a trace is once loaded, whatever its file format.

A trace is a set of *chains*: clients that send their requests one after another,
each after the previous answer plus a think time. A multi-turn agent session is one
chain; its subagents are chains it spawns; an arrival-timed trace (Mooncake) is one
chain per request with its arrival time as the start. This one shape lets a single
replay loop drive both families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

R = TypeVar("R")
S = TypeVar("S")


class TraceFormatError(ValueError):
    """A trace file does not have the shape its format promises; says which file and field."""


@dataclass(frozen=True)
class TraceRequest:
    """One request as the trace records it (lengths in the trace's own tokens)."""

    key: str  # unique in the trace, e.g. "trace_0008#3"
    namespace: str  # hash ids are equal only within one namespace
    hash_ids: tuple[int, ...]  # one per block, prefix-chained
    input_tokens: int
    output_tokens: int
    block_size: int
    think_s: float  # the client's gap after the previous answer in its chain


@dataclass(frozen=True)
class Spawn(Generic[R]):
    """A nested chain (a subagent) started ``delay_s`` after request ``after`` answers
    (``after == -1``: when the parent chain starts). The parent does not wait for it."""

    after: int
    delay_s: float
    chain: Chain[R]


@dataclass(frozen=True)
class Chain(Generic[R]):
    name: str
    start_s: float  # offset from the start of the replay, trace seconds
    requests: tuple[R, ...]
    spawns: tuple[Spawn[R], ...] = ()

    def walk(self) -> Iterator[R]:
        """Every request of this chain and of the chains it spawns."""
        yield from self.requests
        for spawn in self.spawns:
            yield from spawn.chain.walk()

    def map(self, fn: Callable[[R], S]) -> Chain[S]:
        return Chain(
            self.name,
            self.start_s,
            tuple(fn(r) for r in self.requests),
            tuple(Spawn(s.after, s.delay_s, s.chain.map(fn)) for s in self.spawns),
        )

    def rescale(self, factor: float) -> Chain[R]:
        """Start offset and spawn delays multiplied by ``factor`` (trace -> replay time)."""
        spawns = tuple(
            Spawn(s.after, s.delay_s * factor, s.chain.rescale(factor)) for s in self.spawns
        )
        return Chain(self.name, self.start_s * factor, self.requests, spawns)

    def truncate(self, budget: int) -> tuple[Chain[R], int]:
        """This chain cut to at most ``budget`` requests (own first, then spawns in
        order); returns the cut chain and how many requests it kept."""
        own = self.requests[:budget]
        kept = len(own)
        spawns = []
        for spawn in self.spawns:
            if kept >= budget or spawn.after >= len(own):
                break
            child, n = spawn.chain.truncate(budget - kept)
            spawns.append(replace(spawn, chain=child))
            kept += n
        return Chain(self.name, self.start_s, own, tuple(spawns)), kept


@dataclass(frozen=True)
class Trace(Generic[R]):
    name: str
    block_size: int
    chains: tuple[Chain[R], ...]
    notes: tuple[str, ...] = field(default=())

    def walk(self) -> Iterator[R]:
        for chain in self.chains:
            yield from chain.walk()

    def __len__(self) -> int:
        return sum(1 for _ in self.walk())

    def map(self, fn: Callable[[R], S]) -> Trace[S]:
        return Trace(self.name, self.block_size, tuple(c.map(fn) for c in self.chains), self.notes)

    def rescale(self, factor: float) -> Trace[R]:
        return replace(self, chains=tuple(c.rescale(factor) for c in self.chains))

    def limit(self, max_requests: int | None) -> Trace[R]:
        """The first ``max_requests`` requests, whole chains in start order, the last cut."""
        if max_requests is None:
            return self
        chains, left = [], max_requests
        for chain in sorted(self.chains, key=lambda c: c.start_s):
            if left <= 0:
                break
            cut, kept = chain.truncate(left)
            chains.append(cut)
            left -= kept
        return Trace(self.name, self.block_size, tuple(chains), self.notes)


def ideal_hit_ratios(trace: Trace[TraceRequest]) -> dict[str, float]:
    """Per request: the share of its blocks an infinite prefix cache would already hold,
    visiting chains in start order (the trace README's "per-request prefix hit")."""
    seen: dict[str, set[int]] = {}
    out: dict[str, float] = {}
    for chain in sorted(trace.chains, key=lambda c: c.start_s):
        for r in chain.walk():
            cached = seen.setdefault(r.namespace, set())
            hit = 0
            for h in r.hash_ids:
                if h not in cached:
                    break
                hit += 1
            cached.update(r.hash_ids[hit:])
            out[r.key] = hit / len(r.hash_ids) if r.hash_ids else 0.0
    return out
