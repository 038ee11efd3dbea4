"""Per-request sampling whose random draw depends only on (request seed, position).

PDD hands a request from one instance to another mid-generation (relay decode
-> main decode). Both must produce the same token at the same position, or the
client sees a fork. So the randomness is not a stateful generator but a pure
function: the uniform number used for the token at position ``i`` (its index
in the whole sequence, prompt included, so the prompt/output split does not
matter) is ``uniform(seed, i)``, a 64-bit mix of the two. The token is then drawn by
inverse CDF over the filtered distribution, so any instance with the same
logits samples the same token, whatever else is in its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdd.common.wire import GuidedDecoding

_MASK64 = (1 << 64) - 1


class InvalidSamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field and its valid range."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable
    those filters. ``seed=None`` lets the engine pick one at ``add_request`` time;
    pass an explicit seed whenever another instance may continue the request.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    guided: GuidedDecoding | None = None  # structured output: the grammar the output obeys

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidSamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidSamplingParamsError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise InvalidSamplingParamsError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """True when the pick is the argmax: temperature 0, or a filter that keeps one token."""
        return self.temperature == 0 or self.top_k == 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """The random number in [0, 1) used at sequence ``position`` of a request with ``seed``."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 11) / float(1 << 53)


def _filtered_probs(
    logits: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature/top-k/top-p, with the token id of each entry.

    Without top-k/top-p the order is the vocabulary order (no sort needed); with
    them it is descending probability (stable, so ties keep vocabulary order).
    """
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_k == 0 and params.top_p >= 1:
        return probs, torch.arange(probs.numel(), device=probs.device)
    probs, ids = torch.sort(probs, descending=True, stable=True)
    keep = probs.numel()
    if params.top_k:
        keep = min(keep, params.top_k)
    if params.top_p < 1:
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep = min(keep, max(1, int((mass_before < params.top_p).sum().item())))
    return probs[:keep], ids[:keep]


def sample_one(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """Pick the token for one request from its fp32 logits row ``[vocab]``."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs, ids = _filtered_probs(logits, params)
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = uniform(seed, position) * cdf[-1].item()
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype, device=cdf.device)))
    return int(ids[min(index, ids.numel() - 1)].item())


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[int]:
    """Pick one token per row of ``logits`` ``[N, vocab]``.

    Greedy rows share one batched argmax; sampled rows go one by one (each has
    its own filters), which keeps every row independent of its batch mates.
    """
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, p in enumerate(params):
        if not p.greedy:
            tokens[row] = sample_one(logits[row], p, seeds[row], positions[row])
    return tokens
