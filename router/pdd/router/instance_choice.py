"""Which P, MD and RLD instance serves a request: pure functions over load and hits.

* **P** by prefix hit and load: a hit saves prefill compute, but a P with a long queue
  delays the first token more than a miss would.
* **MD** by decode-side cache (DRC) hit and load, with strong affinity: a
  conversation's turns must keep landing on the same MD so its DRC stays aligned with
  P's cache (a drifting MD hit rate pushes more KV over the WAN and more requests to
  relays). When no MD holds any of the prompt, rendezvous hashing on the
  conversation's first block spreads new conversations evenly and deterministically.
* **RLD** least loaded: relays hold no history worth chasing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdd.common.vocabulary import Role


@dataclass(frozen=True)
class InstanceLoad:
    """One instance as the router sees it: its role and how busy it is."""

    instance_id: str
    role: Role
    active: int  # requests it is serving now
    capacity: int  # requests it may serve at once

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError(f"{self.instance_id}: capacity must be positive, got {self.capacity}")
        if self.active < 0:
            raise ValueError(f"{self.instance_id}: active must be >= 0, got {self.active}")

    @property
    def utilization(self) -> float:
        return self.active / self.capacity

    @property
    def saturated(self) -> bool:
        return self.active >= self.capacity


@dataclass(frozen=True)
class ChoiceWeights:
    """How much one unit of utilization costs against one unit of hit fraction.

    P trades hit for load evenly: a full hit on a fully loaded P is worth as much as
    no hit on an idle one. MD weighs load four times lighter because losing DRC
    alignment costs WAN bandwidth on every later turn, not just this request.
    """

    prefill_load: float = 1.0
    main_load: float = 0.25


def available(instances: Iterable[InstanceLoad], role: Role) -> list[InstanceLoad]:
    """Instances of ``role`` that can take one more request."""
    return [i for i in instances if i.role == role and not i.saturated]


def _score(inst: InstanceLoad, hits: Mapping[str, int], input_tokens: int, w: float) -> float:
    hit_fraction = hits.get(inst.instance_id, 0) / input_tokens if input_tokens > 0 else 0.0
    return hit_fraction - w * inst.utilization


def choose_prefill(
    candidates: list[InstanceLoad],
    hits: Mapping[str, int],
    input_tokens: int,
    weights: ChoiceWeights = ChoiceWeights(),
) -> InstanceLoad | None:
    """Best hit-versus-load P; ties go to the lower instance id (deterministic)."""
    if not candidates:
        return None
    return min(
        candidates,
        key=lambda i: (-_score(i, hits, input_tokens, weights.prefill_load), i.instance_id),
    )


def choose_main_decode(
    candidates: list[InstanceLoad],
    hits: Mapping[str, int],
    input_tokens: int,
    affinity_key: int,
    weights: ChoiceWeights = ChoiceWeights(),
) -> InstanceLoad | None:
    """The MD with the best DRC hit against load, or by rendezvous hash when none hits."""
    if not candidates:
        return None
    if not any(hits.get(i.instance_id, 0) > 0 for i in candidates):
        return max(candidates, key=lambda i: rendezvous_weight(affinity_key, i.instance_id))
    return min(
        candidates, key=lambda i: (-_score(i, hits, input_tokens, weights.main_load), i.instance_id)
    )


def choose_relay(candidates: list[InstanceLoad]) -> InstanceLoad | None:
    """Least-loaded relay; ties go to the lower instance id."""
    if not candidates:
        return None
    return min(candidates, key=lambda i: (i.utilization, i.instance_id))


def rendezvous_weight(key: int, instance_id: str) -> int:
    """Highest-random-weight hashing: each key prefers one instance, and removing an
    instance only moves the keys that preferred it."""
    digest = hashlib.sha256(struct.pack("<Q", key & ((1 << 64) - 1)) + instance_id.encode())
    return int.from_bytes(digest.digest()[:8], "little")
