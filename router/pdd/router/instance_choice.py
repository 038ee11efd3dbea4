"""Which P, MD and RLD instance serves a request: choices over a :class:`Fleet`.

* **P** by prefix hit and load: a hit saves prefill compute, but a P with a long queue
  delays the first token more than a miss would.
* **MD** by decode-side cache (DRC) hit and load, with strong affinity: a
  conversation's turns must keep landing on the same MD so its DRC stays aligned with
  P's cache (a drifting MD hit rate pushes more KV over the WAN and more requests to
  relays). When no MD holds any of the prompt, consistent hashing on the
  conversation's first block (:class:`AffinityRing`) spreads new conversations evenly
  and deterministically.
* **RLD** least loaded: relays hold no history worth chasing.

None of them scans the fleet. An instance that holds none of the prompt scores
``-w * utilization``, so the best of those is the least utilized one, the root of the
role's :class:`LoadOrder`; only the holders (from the prefix index) are scored one by
one. The result is the instance a full scan of ``(-score, instance_id)`` would pick.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdd.common.vocabulary import Role
from pdd.router.fleet import Fleet
from pdd.router.instance_load import InstanceLoad
from pdd.router.load_order import LoadOrder

__all__ = ["ChoiceWeights", "InstanceLoad", "choose_main_decode", "choose_prefill", "choose_relay"]


@dataclass(frozen=True)
class ChoiceWeights:
    """How much one unit of utilization costs against one unit of hit fraction.

    P trades hit for load evenly: a full hit on a fully loaded P is worth as much as
    no hit on an idle one. MD weighs load four times lighter because losing DRC
    alignment costs WAN bandwidth on every later turn, not just this request.
    Positive, so that among instances without a hit the least utilized scores best.
    """

    prefill_load: float = 1.0
    main_load: float = 0.25

    def __post_init__(self) -> None:
        if self.prefill_load <= 0 or self.main_load <= 0:
            raise ValueError(
                f"load weights must be positive, got prefill_load={self.prefill_load}, "
                f"main_load={self.main_load}"
            )


def _score(inst: InstanceLoad, hits: Mapping[str, int], input_tokens: int, w: float) -> float:
    hit_fraction = hits.get(inst.instance_id, 0) / input_tokens if input_tokens > 0 else 0.0
    return hit_fraction - w * inst.utilization


def _best(
    order: LoadOrder, hits: Mapping[str, int], input_tokens: int, w: float
) -> InstanceLoad | None:
    """Best hit-versus-load instance of ``order``; ties go to the lower instance id.
    O(|hits| log n): the holders scored one by one, the best non-holder read off the tree."""
    candidates = [load for i in hits if (load := order.available(i)) is not None]
    best_other = order.least_loaded(skip=hits)
    if best_other is not None:
        candidates.append(best_other)
    if not candidates:
        return None
    return min(candidates, key=lambda i: (-_score(i, hits, input_tokens, w), i.instance_id))


def choose_prefill(
    fleet: Fleet,
    hits: Mapping[str, int],
    input_tokens: int,
    weights: ChoiceWeights = ChoiceWeights(),
) -> InstanceLoad | None:
    """Best hit-versus-load P that can take the request; None when every P is full."""
    return _best(fleet.role(Role.PREFILL), hits, input_tokens, weights.prefill_load)


def choose_main_decode(
    fleet: Fleet,
    hits: Mapping[str, int],
    input_tokens: int,
    affinity_key: int,
    weights: ChoiceWeights = ChoiceWeights(),
) -> InstanceLoad | None:
    """The MD with the best DRC hit against load, or by the affinity ring when none hits."""
    order = fleet.role(Role.MAIN)
    if any(hits[i] > 0 and order.available(i) is not None for i in hits):
        return _best(order, hits, input_tokens, weights.main_load)
    if order.least_loaded() is None:
        return None
    return next(
        load
        for i in fleet.ring(Role.MAIN).preference(affinity_key)
        if (load := order.available(i)) is not None
    )


def choose_relay(fleet: Fleet) -> InstanceLoad | None:
    """Least-loaded relay; ties go to the lower instance id."""
    return fleet.role(Role.RELAY).least_loaded()
