"""The SLO planner of one PDDDeployment, as the operator runs it: the simulator's
:class:`~pdd.simulator.planner.planner.Planner` fed one scraped interval at a time.

Pure: ``planner_for`` builds the loop from the spec (which
:class:`~pdd.simulator.planner.scrape.PlannerRound` steps on two scrapes), and
``line_condition`` says whether the WAN line is the bottleneck.
The I/O (listing pods, scraping them, publishing, writing status) is
:mod:`pdd.operator.planner_loop`.

Pool names: the simulator's (``prefill``, ``relay``, ``main``) are the worker roles'
(:class:`~pdd.operator.naming.Component`), so a decision's keys are the ``role`` label
of ``pdd_planner_desired_replicas`` and of each role's HPA selector.
"""

from __future__ import annotations

from pdd.operator.conditions import Condition
from pdd.operator.naming import WORKER_ROLES, Component
from pdd.operator.spec import PDDSpec, PlannerPool
from pdd.simulator.planner.capacity import DeploymentModel
from pdd.simulator.planner.load import Slo
from pdd.simulator.planner.planner import Decision, Planner
from pdd.simulator.planner.pools import PoolBounds
from pdd.simulator.planner.predict import PREDICTORS

#: The status condition the planner owns.
LINE_BOUND = "LineBound"


def _bounds(pool: PlannerPool, role: Component) -> PoolBounds:
    """A role's bounds; every replica costs the same where ``costPerHour`` is unset (the
    loop sizes each pool for the SLO on its own: prices rank pools only in a search)."""
    cost = 1.0 if pool.cost_per_hour is None else pool.cost_per_hour
    return PoolBounds(str(role), cost, pool.min_replicas, pool.max_replicas)


def planner_pools(spec: PDDSpec) -> dict[str, PoolBounds]:
    planner = spec.planner
    pools = {Component.PREFILL: planner.prefill, Component.RELAY: planner.relay,
             Component.MAIN: planner.main_decode}  # fmt: skip
    return {str(role): _bounds(pools[role], role) for role in WORKER_ROLES}


def planner_slo(spec: PDDSpec) -> Slo:
    """``spec.slo``'s P90 targets (admission refuses ``planner.enabled`` without both)."""
    ttft, itl = spec.slo.ttft_p90_seconds, spec.slo.itl_p90_seconds
    if ttft is None or itl is None:
        raise ValueError("spec.planner.enabled needs slo.ttftP90Seconds and slo.itlP90Seconds")
    return Slo(ttft, itl)


def planner_for(spec: PDDSpec, model: DeploymentModel) -> Planner:
    """The loop for ``spec``: its SLO, its pools' bounds, its predictor."""
    predictor = PREDICTORS[spec.planner.predictor]()
    return Planner(model, planner_pools(spec), planner_slo(spec), predictor)


def line_condition(decision: Decision) -> Condition:
    """LineBound: True when MD's misses need more of the line than it carries, which no
    replica count fixes."""
    load = decision.predicted
    if decision.line_bound:
        return Condition(
            LINE_BOUND,
            "True",
            "WanLineIsTheBottleneck",
            f"MD's prefix misses need about {decision.line_gbps_needed:.1f} Gbit/s of the WAN "
            f"line, which carries {load.wan_gbps:.1f} Gbit/s as measured: more replicas "
            "cannot meet the SLO; a faster line, a KV codec (spec.wan.kvCodec) or a higher MD "
            "hit ratio can",
        )
    return Condition(
        LINE_BOUND,
        "False",
        "LineSufficient",
        f"MD's prefix misses need about {decision.line_gbps_needed:.1f} Gbit/s of the WAN line",
    )
