"""Is the WAN line usable for P-MD now? Learned from the transfers themselves.

The policy assumes the line works; a cut or a stall breaks that, and a P-MD request
sent over a broken line has no relay to carry it: it waits for a failure, then a retry.
So the router keeps one state per line:

- **healthy**: the policy chooses freely;
- **suspected_cut**: a transfer could not reach MD (refused, reset, no handshake
  answer within P's connect timeout);
- **degraded**: a transfer connected, then stopped moving within P's timeout.

It is fed by what P reports on its stream when a request's KV could not cross
(``TokenEvent.link_fault``: seconds after the cut, not MD's 30 s transfer timeout).
While the line is not healthy the policy does not choose P-MD (a relay goes on the
route, so the request completes either way), and each such P-RLD-MD request *is*
the probe: its KV crosses the very path that failed, with the relay as the net. The
first one that lands (P reports MD imported it, or MD streams a token) proves the
line again. MD's ``/health``
would not: the router's HTTP calls to MD need not take the line the KV takes.

A success only counts for a transfer routed after the last failure (its *ticket*),
so a request that crossed before the cut and streams on cannot clear it.

Pure state, no I/O, its clock injected: the simulator can hold one too. One
instance per line; this router is configured with one (``RouterConfig.link``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from pdd.common.vocabulary import LinkFault

log = logging.getLogger(__name__)


class LinkCondition(StrEnum):
    HEALTHY = "healthy"
    SUSPECTED_CUT = "suspected_cut"
    DEGRADED = "degraded"


_CONDITION_OF: dict[LinkFault, LinkCondition] = {
    LinkFault.UNREACHABLE: LinkCondition.SUSPECTED_CUT,
    LinkFault.STALLED: LinkCondition.DEGRADED,
}


@dataclass(frozen=True)
class Transition:
    link: str
    before: LinkCondition
    after: LinkCondition
    why: str
    #: Seconds the line spent in ``before``.
    lasted_s: float


class LinkHealth:
    """The condition of one line and the ticket that dates the transfers routed over it."""

    def __init__(
        self,
        name: str,
        on_transition: Callable[[Transition], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.condition = LinkCondition.HEALTHY
        self._why = ""
        self._ticket = 0
        self._on_transition = on_transition
        self._clock = clock
        self._since = clock()

    @property
    def ticket(self) -> int:
        """Stamp a route with this when it is chosen; hand it back to :meth:`delivered`."""
        return self._ticket

    def doubt(self) -> str | None:
        """Why the line is not trusted for P-MD now (for the policy's reason), or None."""
        if self.condition is LinkCondition.HEALTHY:
            return None
        return f"the WAN line is {self.condition} ({self._why})"

    def failed(self, fault: LinkFault, detail: str) -> None:
        """A transfer over the line failed; successes routed before it no longer count."""
        self._ticket += 1
        self._set(_CONDITION_OF[fault], detail)

    def delivered(self, ticket: int) -> None:
        """KV routed with ``ticket`` reached MD: the line works, if no failure came since."""
        if ticket == self._ticket and self.condition is not LinkCondition.HEALTHY:
            self._set(LinkCondition.HEALTHY, "a transfer routed after the last failure crossed")

    def _set(self, condition: LinkCondition, why: str) -> None:
        self._why = why
        if condition is self.condition:
            return
        now = self._clock()
        change = Transition(self.name, self.condition, condition, why, now - self._since)
        self.condition, self._since = condition, now
        log.log(
            logging.INFO if condition is LinkCondition.HEALTHY else logging.WARNING,
            "WAN line %s: %s -> %s after %.1fs: %s",
            change.link,
            change.before,
            change.after,
            change.lasted_s,
            why,
        )
        if self._on_transition is not None:
            self._on_transition(change)
