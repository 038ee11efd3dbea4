"""The generator's hit model, the technique's skew: a turn's ideal prefix hit against its
session's previous turn lies in (0.95, 1] with probability ``share`` and in [0, 0.95)
otherwise, with a target overall mean. Which (mean, share) pairs are reachable, and
how a draw is made.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TypeVar

#: The boundary of the skewed head, in percent so block counts compare exactly.
HIGH_PERCENT = 95
HIGH_HIT = HIGH_PERCENT / 100
#: Within each class a hit is Beta-shaped with this concentration (2: uniform at mid-mean) ...
_CONCENTRATION = 2.0
#: ... and a class mean stays within this fraction of its interval (no degenerate spikes).
_SHAPE_MEAN = (0.02, 0.98)
#: The head's mean when the tail can absorb the rest of the target: U(0.95, 1].
_HEAD_MEAN = (1 + HIGH_HIT) / 2

_Number = TypeVar("_Number", int, float)


def clamp(x: _Number, lo: _Number, hi: _Number) -> _Number:
    """``x`` within [lo, hi], of the arguments' type (ints stay ints: block counts)."""
    return min(max(x, lo), hi)


def _class_means() -> tuple[float, float, float, float]:
    """(head low, head high, tail low, tail high): the reachable mean of each class."""
    lo, hi = _SHAPE_MEAN
    return 1 - (1 - HIGH_HIT) * hi, 1 - (1 - HIGH_HIT) * lo, HIGH_HIT * lo, HIGH_HIT * hi


def mean_range(share: float) -> tuple[float, float]:
    """The mean hit rates reachable with ``share`` of turns above 95%."""
    head_lo, head_hi, tail_lo, tail_hi = _class_means()
    return share * head_lo + (1 - share) * tail_lo, share * head_hi + (1 - share) * tail_hi


def share_range(mean: float) -> tuple[float, float]:
    """The shares above 95% that can reach ``mean`` (empty when lo > hi)."""
    head_lo, head_hi, tail_lo, tail_hi = _class_means()
    lo = (mean - tail_hi) / (head_hi - tail_hi)
    hi = (mean - tail_lo) / (head_lo - tail_lo)
    return max(lo, 0.0), min(hi, 1.0)


@dataclass(frozen=True)
class HitMix:
    """How a turn's hit is drawn: in the head (0.95, 1] with probability ``share`` as
    1 - 0.05 V, else in the tail [0, 0.95) as 0.95 W; V and W are Beta with means
    ``head_miss`` and ``tail_fill``. The head stays uniform (mean 0.975) and the tail
    takes up the rest of the target mean; only when the tail cannot does the head move."""

    share: float
    head_miss: float
    tail_fill: float

    @classmethod
    def solve(cls, mean: float, share: float) -> HitMix:
        lo, hi = mean_range(share)
        if not lo - 1e-9 <= mean <= hi + 1e-9:
            raise ValueError(_unreachable(mean, share, lo, hi))
        if share >= 1:
            return cls(1.0, clamp((1 - mean) / (1 - HIGH_HIT), *_SHAPE_MEAN), 0.5)
        tail = clamp((mean - share * _HEAD_MEAN) / (1 - share) / HIGH_HIT, *_SHAPE_MEAN)
        head = (mean - (1 - share) * HIGH_HIT * tail) / share if share > 0 else _HEAD_MEAN
        return cls(share, clamp((1 - head) / (1 - HIGH_HIT), *_SHAPE_MEAN), tail)

    def draw(self, rng: random.Random) -> tuple[bool, float]:
        """(in the head, hit)."""
        if rng.random() < self.share:
            return True, 1 - (1 - HIGH_HIT) * _beta(rng, self.head_miss)
        return False, HIGH_HIT * _beta(rng, self.tail_fill)


def _beta(rng: random.Random, mean: float) -> float:
    return rng.betavariate(_CONCENTRATION * mean, _CONCENTRATION * (1 - mean))


def _unreachable(mean: float, share: float, lo: float, hi: float) -> str:
    s_lo, s_hi = share_range(mean)
    fix = (
        f"for mean_hit_rate {mean:g} use above_95_share in [{s_lo:.3f}, {s_hi:.3f}] "
        "(GeneratorSpec.for_mean_hit picks one)"
        if s_lo <= s_hi
        else f"mean_hit_rate must be in [{mean_range(0)[0]:.3f}, {mean_range(1)[1]:.3f}]"
    )
    return (
        f"mean_hit_rate {mean:g} is out of reach with above_95_share {share:g}: that share "
        f"allows a mean in [{lo:.3f}, {hi:.3f}]; {fix}"
    )
