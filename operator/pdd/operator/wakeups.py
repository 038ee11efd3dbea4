"""When to refresh a PDDDeployment's readiness: on its children's events, not on a timer.

A timer per PDDDeployment would read every child Deployment every interval forever: API
load growing with the number of deployments even when nothing changes. Instead kopf
watches cluster A's child Deployments (one watch for all of them) and a change in one's
readiness wakes its owner's refresh. Cluster B cannot be watched (kopf watches one
cluster), so a remote MD is still polled, but backing off while it does not change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from pdd.operator.readiness import role_status

#: What a child's readiness depends on (``readiness.role_status`` of it), compared to
#: tell a real change from kopf replaying every object when its watch restarts.
Snapshot = tuple[tuple[str, Any], ...]


def snapshot(deployment: dict[str, Any]) -> Snapshot:
    return tuple(sorted(role_status(0, deployment).items()))


def pull_snapshot(pod: dict[str, Any]) -> Snapshot:
    """What the ModelAvailable condition reads of a pod: its model-pull init container's
    state and termination (restart counts left out: a failing pull's restarts say
    nothing new)."""
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    out: list[tuple[str, Any]] = []
    for status in statuses:
        for key in ("state", "lastState"):
            for kind, detail in (status.get(key) or {}).items():
                detail = detail or {}
                where = f"{status.get('name')}.{key}.{kind}"
                out.append((where, (detail.get("exitCode"), detail.get("message"))))
    return tuple(sorted(out, key=str))


def next_poll_s(previous: float | None, changed: bool, first_s: float, max_s: float) -> float:
    """Seconds until the next poll of cluster B: ``first_s`` after a change (a rollout is
    under way), doubling up to ``max_s`` while nothing changes."""
    if previous is None or changed:
        return first_s
    return min(previous * 2, max_s)


class ReadinessWakeups:
    """One wake-up flag per PDDDeployment (by uid), set by its children's events."""

    def __init__(self) -> None:
        self._flags: dict[str, asyncio.Event] = {}
        self._seen: dict[tuple[str, str], Snapshot] = {}

    def child_changed(self, owner_uid: str, child: tuple[str, str], seen: Snapshot | None) -> bool:
        """Record a child Deployment's readiness (None: deleted) and wake its owner's
        refresh if it differs from what was last seen. Returns whether it differed."""
        if seen is None:
            if self._seen.pop(child, None) is None:
                return False
        elif self._seen.get(child) == seen:
            return False
        else:
            self._seen[child] = seen
        self.wake(owner_uid)  # none watching yet? its first refresh reads this anyway
        return True

    def wake(self, owner_uid: str) -> None:
        """Wake an owner's refresh now (its spec changed: maybe where its MD runs)."""
        flag = self._flags.get(owner_uid)
        if flag is not None:
            flag.set()

    def watch(self, owner_uid: str) -> None:
        """Start collecting wake-ups for an owner, before its first refresh reads."""
        self._flag(owner_uid)

    def wake_all(self) -> None:
        """Wake every waiting refresh (the operator is exiting: they should see it)."""
        for flag in self._flags.values():
            flag.set()

    async def wait(self, owner_uid: str, stopped: Awaitable[Any], timeout_s: float | None) -> None:
        """Until the owner is woken, ``stopped`` completes, or ``timeout_s`` passes (None:
        no timeout); the wake-up is consumed."""
        flag = self._flag(owner_uid)
        waits = [asyncio.ensure_future(flag.wait()), asyncio.ensure_future(stopped)]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        flag.clear()

    def forget(self, owner_uid: str) -> None:
        self._flags.pop(owner_uid, None)

    def _flag(self, owner_uid: str) -> asyncio.Event:
        return self._flags.setdefault(owner_uid, asyncio.Event())
