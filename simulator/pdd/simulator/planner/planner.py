"""The planner loop: each interval, one observation in, desired replicas per pool out.

It predicts the next interval's load (:mod:`pdd.simulator.planner.predict`), sizes the
pools with the capacity model (:mod:`pdd.simulator.planner.capacity`), and corrects that
model with what clients measured: a pool whose queue made the TTFT (or ITL) P90 miss
its target gets a larger headroom factor, which decays back in every interval that met
both targets. The operator's planner, and the simulated day's autoscaler, run this
class; it keeps no clock and does no I/O.

The WAN line is the bottleneck when MD's misses need more than ``LINE_BOUND`` of the
rate the router's link estimator measures: more replicas cannot fix that, so it is a
verdict (a status condition), not a replica count.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from pdd.simulator.planner.capacity import LINE_UTILIZATION, DeploymentModel, size
from pdd.simulator.planner.load import ObservedLoad, Slo
from pdd.simulator.planner.pools import PoolBounds
from pdd.simulator.planner.predict import LastValue, Predictor

#: The line is the bottleneck when MD's misses need more than this share of its rate.
LINE_BOUND = 0.9
#: Headroom bounds, and how fast it decays back to 1 per interval that met the SLO.
HEADROOM = (0.5, 4.0)
HEADROOM_DECAY = 0.9
#: A pool "queued" in an interval when its queue-time P90 reached this share of the TTFT
#: target: below it, the queue explains less than a tenth of the target, and a TTFT miss
#: is the line, a handoff or the machine, which no pool's replicas can fix.
QUEUED = 0.1
#: A headroom this close to 1 is 1: its decay only nears 1, and ceil(n * (1 + tiny)) would
#: keep a pool one replica above its sizing for ever.
HEADROOM_SNAP = 0.05


@dataclass(frozen=True)
class Decision:
    replicas: dict[str, int]
    line_bound: bool  # the WAN line, not a replica count, limits the SLO
    line_gbps_needed: float
    predicted: ObservedLoad
    headroom: dict[str, float]
    #: The interval the headroom was corrected on, and the pool its TTFT miss was put on
    #: (``queued_pool``; None: TTFT met, or no pool queued): what a reason must name.
    observed: ObservedLoad
    blamed: str | None


def line_is_bottleneck(model: DeploymentModel, load: ObservedLoad) -> bool:
    """MD's misses at ``load`` need more than ``LINE_BOUND`` of the measured line rate."""
    if not math.isfinite(load.wan_gbps):
        return False
    bits = load.rate_rps * load.md_miss_tokens * model.kv_bytes_per_token * 8
    return bits / 1e9 > LINE_BOUND * load.wan_gbps


def queued_pool(load: ObservedLoad, slo: Slo, decode: str) -> str | None:
    """The pool a TTFT miss is blamed on: the one whose queue-time P90 was longest and at
    least ``QUEUED`` of the TTFT target; None when neither queued that long (NaN, none
    measured, is no queue)."""
    floor = QUEUED * slo.ttft_p90_s
    waits = {"prefill": load.prefill_queue_p90_s, decode: load.main_queue_p90_s}
    queued = {name: w for name, w in waits.items() if w >= floor}
    return max(queued, key=lambda name: queued[name]) if queued else None


class Planner:
    """Desired replicas per pool from a stream of interval observations."""

    def __init__(
        self,
        model: DeploymentModel,
        pools: Mapping[str, PoolBounds],
        slo: Slo,
        predictor: Predictor | None = None,
        history: int = 12,
    ) -> None:
        self.model, self.pools, self.slo = model, dict(pools), slo
        self.predictor = predictor or LastValue()
        self.history: deque[ObservedLoad] = deque(maxlen=history)
        self.headroom = {name: 1.0 for name in pools}

    def observe(self, load: ObservedLoad) -> Decision:
        """Take the last interval's observation; return the next interval's replicas."""
        self.history.append(load)
        blamed = self._blame(load)
        self._correct(load, blamed)
        predicted = self.predictor.predict(list(self.history))
        sized = size(self.model, predicted, self.slo)
        replicas = {}
        for name, bounds in self.pools.items():
            n = sized.get(name)
            want = bounds.max_replicas if n is None else math.ceil(n * self.headroom[name])
            replicas[name] = bounds.clamp(want)
        needed = predicted.rate_rps * predicted.md_miss_tokens * self.model.kv_bytes_per_token
        return Decision(
            replicas=replicas,
            line_bound=line_is_bottleneck(self.model, load),
            line_gbps_needed=needed * 8 / 1e9 / LINE_UTILIZATION,
            predicted=predicted,
            headroom=dict(self.headroom),
            observed=load,
            blamed=blamed,
        )

    @property
    def _decode(self) -> str:
        """The decode pool's name: MD's, or a same-datacenter deployment's decode."""
        return "main" if "main" in self.pools else "decode"

    def _blame(self, load: ObservedLoad) -> str | None:
        """The pool a TTFT miss in ``load`` is put on (``queued_pool``); None when TTFT met
        its target (NaN, not measured, meets it) or no pool queued."""
        if not load.ttft_p90_s > self.slo.ttft_p90_s:
            return None
        return queued_pool(load, self.slo, self._decode)

    def _correct(self, load: ObservedLoad, blamed: str | None) -> None:
        """Grow the headroom of the pool that made a P90 miss; relax it when both were met.

        A TTFT miss is the pool's whose requests queued longest (queue-time P90, at least
        ``QUEUED`` of the target), or nobody's: a miss with nothing queued is the line,
        a handoff or the machine, and more replicas would only cost more. Headroom is the
        loop's correction for a model that sized too few; an interval that met both
        targets with it is evidence it is no longer needed in full, so it decays there,
        not only in intervals far under target: the normal operating point of a well-sized
        pool is near its target, and on a sizing of 1 any headroom of 1.05 or more is 2
        replicas (``ceil``), so waiting for "comfortable" intervals held burst capacity
        for ever. A decay that overshoots costs one miss, which grows it back.
        """
        missed = []
        if load.itl_p90_s > self.slo.itl_p90_s:
            missed.append((self._decode, load.itl_p90_s / self.slo.itl_p90_s))
        if blamed is not None and not line_is_bottleneck(self.model, load):
            missed.append((blamed, load.ttft_p90_s / self.slo.ttft_p90_s))
        for name, ratio in missed:
            grown = self.headroom[name] * (1 + min(0.5, (ratio - 1) / 2))
            self.headroom[name] = min(HEADROOM[1], grown)
        met = load.ttft_p90_s <= self.slo.ttft_p90_s and load.itl_p90_s <= self.slo.itl_p90_s
        if met:  # NaN (not measured) compares False: no decay on no data
            for name in self.headroom:
                relaxed = 1 + (self.headroom[name] - 1) * HEADROOM_DECAY
                if abs(relaxed - 1) < HEADROOM_SNAP:
                    relaxed = 1.0
                self.headroom[name] = max(HEADROOM[0], relaxed)
