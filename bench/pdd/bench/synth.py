"""Trace requests -> token IDs a small model can serve, keeping the prefix structure.

Traces carry block hash ids, not text. Block ``j`` of a request (hash id ``h``)
becomes the token span ``[floor(j * k), floor((j + 1) * k))`` with ``k`` tokens per
block (``k`` may be below one: a 64-token block can shrink to a quarter token),
filled from a generator seeded by ``(namespace, h)``. Hash ids are prefix-chained, so
an id always sits at the same block index: equal ids give identical token spans, and
two requests that share ``m`` leading ids share their first ``floor(m * k)`` tokens,
which is exactly the prefix structure the caches should see. Input past the last
hashed block (a partial tail) is filled from the request's own key, so it is unique.

Output lengths scale by their own factor (they set decode time, not KV volume), and
time (think gaps, arrival offsets) by another. ``Scaling.describe`` prints all three.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

from pdd.local.traces.base import Trace, TraceRequest


class ScalingError(ValueError):
    """A scaling flag is out of range; the message says which and why."""


@dataclass(frozen=True)
class Scaling:
    tokens_per_block: float  # synthesized tokens per trace block
    output_scale: float = 1 / 16
    min_output_tokens: int = 1
    max_output_tokens: int = 128
    time_scale: float = 0.01  # replay seconds per trace second
    max_think_s: float = 300.0  # trace seconds; a longer gap is a person away, not load
    max_context_tokens: int = 4096  # prompt + output must fit the model
    token_low: int = 32  # synthesized ids are drawn from [token_low, token_high)
    token_high: int = 127  # printable ASCII: valid ids for the byte-level tiny model

    def __post_init__(self) -> None:
        checks = {
            "tokens_per_block": self.tokens_per_block > 0,
            "output_scale": self.output_scale > 0,
            "time_scale": self.time_scale >= 0,
            "max_think_s": self.max_think_s >= 0,
            "min_output_tokens": 1 <= self.min_output_tokens <= self.max_output_tokens,
            "token range": 0 <= self.token_low < self.token_high,
        }
        for name, ok in checks.items():
            if not ok:
                raise ScalingError(f"scaling {name} is out of range in {self}")

    def output_tokens(self, trace_output: int) -> int:
        scaled = round(trace_output * self.output_scale)
        return max(self.min_output_tokens, min(self.max_output_tokens, scaled))

    def describe(self, block_size: int) -> str:
        k = self.tokens_per_block
        return (
            f"scaling: 1 trace block ({block_size} tokens) -> {k:g} tokens "
            f"(input x{k / block_size:.4g}); output x{self.output_scale:.4g} clamped to "
            f"[{self.min_output_tokens}, {self.max_output_tokens}]; time x{self.time_scale:g} "
            f"(think gaps capped at {self.max_think_s:g} s of trace time); "
            f"requests longer than {self.max_context_tokens} tokens in all are skipped"
        )


@dataclass(frozen=True)
class Job:
    """One request ready to send: what the replay needs and nothing else."""

    key: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    think_s: float  # scaled
    fits: bool  # False: longer than the model's context, skipped (and counted)


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class TokenSynthesizer:
    """Builds prompts; caches each block's span, since sessions resend their history."""

    scaling: Scaling
    _spans: dict[tuple[str, int], tuple[int, ...]] = field(default_factory=dict)

    def _draw(self, seed: int, n: int) -> tuple[int, ...]:
        rng = random.Random(seed)
        lo, hi = self.scaling.token_low, self.scaling.token_high
        return tuple(rng.randrange(lo, hi) for _ in range(n))

    def _span(self, namespace: str, j: int, h: int) -> tuple[int, ...]:
        key = (namespace, h)
        span = self._spans.get(key)
        if span is None:
            k = self.scaling.tokens_per_block
            n = math.floor((j + 1) * k) - math.floor(j * k)
            span = self._spans[key] = self._draw(_seed(namespace, h), n)
        return span

    def prompt_ids(self, r: TraceRequest) -> tuple[int, ...]:
        k = self.scaling.tokens_per_block
        total = max(1, round(r.input_tokens * k / r.block_size))
        ids: list[int] = []
        for j, h in enumerate(r.hash_ids):
            ids += self._span(r.namespace, j, h)
        if len(ids) < total:
            ids += self._draw(_seed(r.namespace, r.key, "tail"), total - len(ids))
        return tuple(ids[:total])

    def job(self, r: TraceRequest) -> Job:
        prompt = self.prompt_ids(r)
        max_tokens = self.scaling.output_tokens(r.output_tokens)
        return Job(
            key=r.key,
            prompt_ids=prompt,
            max_tokens=max_tokens,
            think_s=min(r.think_s, self.scaling.max_think_s) * self.scaling.time_scale,
            fits=len(prompt) + max_tokens <= self.scaling.max_context_tokens,
        )


def synthesize(trace: Trace[TraceRequest], scaling: Scaling) -> Trace[Job]:
    """The trace with every request turned into a ``Job``, in replay time."""
    return trace.map(TokenSynthesizer(scaling).job).rescale(scaling.time_scale)
