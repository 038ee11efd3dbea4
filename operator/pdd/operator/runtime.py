"""What the operator process holds between handler calls: options and API clients."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

import kopf

from pdd.operator.kube import KubeApi
from pdd.operator.planner_publish import PlannerMetrics
from pdd.operator.remote import RemoteClients
from pdd.operator.spec import Tracing
from pdd.operator.wakeups import ReadinessWakeups


@dataclass(frozen=True)
class OperatorOptions:
    #: Seconds between two readings of a cluster B MD's readiness into status while it
    #: changes (cluster A's children are watched, not polled).
    status_interval_s: float = 15.0
    #: The longest wait between two of those readings: they back off to it while the MD's
    #: readiness stays the same, so idle deployments cost few API calls.
    status_interval_max_s: float = 300.0
    #: Seconds before retrying when cluster B is not reachable yet (missing Secret).
    remote_retry_delay_s: float = 30.0
    #: Deletion retries while cluster B is unreachable before giving up on its objects
    #: (with a Warning event naming the leftovers) so a dead cluster cannot block deletion.
    remote_cleanup_retries: int = 3
    #: spec.observability.tracing for PDDDeployments that set none (the chart's values).
    default_tracing: Tracing | None = None
    #: The scenario whose step model (GPUs, model, pool shapes) the planner sizes with:
    #: a shipped name (``pdd simulate --list``) or a YAML file (docs/planner.md).
    planner_scenario: str = "published"
    #: Where the planner's metrics are served (``pdd_planner_desired_replicas``); None: nowhere.
    planner_metrics_port: int | None = None
    planner_metrics_host: str = "0.0.0.0"
    #: Seconds between planner rounds for every deployment; None: each one's
    #: ``spec.planner.intervalSeconds`` (at least 10; tests go faster).
    planner_interval_s: float | None = None


@dataclass
class OperatorRuntime:
    """Shared by every handler through kopf's memo (per-object memos copy the reference)."""

    options: OperatorOptions
    local: KubeApi | None = None
    remotes: RemoteClients = field(default_factory=RemoteClients)
    wakeups: ReadinessWakeups = field(default_factory=ReadinessWakeups)
    planner_metrics: PlannerMetrics = field(default_factory=PlannerMetrics)
    #: The planner metrics endpoint, while served (``OperatorOptions.planner_metrics_port``).
    planner_server: WSGIServer | None = None
    #: Set by the cleanup activity when the operator exits.
    stopping: bool = False
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    async def connect_local(self) -> KubeApi:
        """(Re)build the cluster A client on each kopf login (kopf logs in again when the
        API server refuses its credentials, which is when ours may need renewing too)."""
        if self.local is not None:
            await self.local.aclose()
        self.local = await KubeApi.local()
        return self.local

    async def aclose(self) -> None:
        """Close the API clients (the operator is exiting)."""
        if self.local is not None:
            await self.local.aclose()
            self.local = None
        await self.remotes.aclose()
        if self.planner_server is not None:
            await asyncio.to_thread(self.planner_server.shutdown)
            self.planner_server.server_close()
            self.planner_server = None

    @property
    def api(self) -> KubeApi:
        if self.local is None:
            raise kopf.TemporaryError("not logged in to the local API server yet", delay=1)
        return self.local

    def lock(self, uid: str) -> asyncio.Lock:
        """Serializes status writes of one PDDDeployment (reconcile vs readiness refresh)."""
        return self._locks.setdefault(uid, asyncio.Lock())

    def forget(self, uid: str) -> None:
        self._locks.pop(uid, None)
