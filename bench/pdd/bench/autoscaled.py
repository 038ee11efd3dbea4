"""``pdd bench --autoscale``: the pdd mode's stack sized by ``pdd up --autoscale``'s
planner while the trace replays, its replicas recorded over time.

The stack is brought up as ``pdd up --autoscale`` brings it up (every slot rendered and
told to the router, each tier's first replicas started) and the same
:class:`~pdd.local.autoscale.Autoscaler` ticks in a thread beside the replay. What the
run reports: each tier's replicas over time, each decision's line, and each scale-down's
end: drained, or cut by its drain deadline (the requests a scale-down aborted; the
client sees those as failures too).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pdd.local.autoscale import DRAINS_CUT, Autoscaler, AutoscaleSettings, Say, for_stack
from pdd.local.stack import LocalStack

#: Between ticks; a tick acts only every ``--autoscale-interval-s``.
TICK_S = 0.5
#: Longest to wait, after the replay, for workers still draining to exit.
DRAIN_WAIT_S = 120.0


class AutoscaleRun:
    """The autoscaler ticking in a thread, from ``start`` until ``finish``."""

    def __init__(self, stack: LocalStack, settings: AutoscaleSettings, say: Say) -> None:
        self.say = say
        self.t0 = time.monotonic()
        self.events: list[tuple[float, str]] = []
        self.autoscaler: Autoscaler = for_stack(stack, settings, self._said)
        self.replicas: list[tuple[float, dict[str, int]]] = [(0.0, self._counts())]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscale", daemon=True)

    def _counts(self) -> dict[str, int]:
        return self.autoscaler.scaler.counts()

    def _said(self, line: str) -> None:
        self.events.append((time.monotonic() - self.t0, line))
        self.say(line)

    def _tick(self) -> None:
        self.autoscaler.tick(time.monotonic())
        counts = self._counts()
        if counts != self.replicas[-1][1]:
            self.replicas.append((time.monotonic() - self.t0, counts))

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            self._tick()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._thread.start()

    def finish(self) -> dict[str, Any]:
        """Stop deciding, wait for the workers still draining to exit, and say what
        happened."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + DRAIN_WAIT_S
        while self.autoscaler.scaler.draining() and time.monotonic() < deadline:
            time.sleep(TICK_S)
        self.autoscaler.report_exits()
        return self.document()

    def document(self) -> dict[str, Any]:
        """Replicas over time, every line said, and how the scale-downs ended."""
        exits = [line for _, line in self.events if " exited with code " in line]
        return {
            "replicas": [[round(t, 1), counts] for t, counts in self.replicas],
            "events": [[round(t, 1), line] for t, line in self.events],
            "drained": sum(1 for line in exits if "(drained)" in line),
            "drains_cut": sum(1 for line in exits if DRAINS_CUT in line),
        }


def replicas_table(mode: str, run: dict[str, Any]) -> str:
    """Each tier's replicas from each change on, and how the scale-downs ended."""
    changes = run["replicas"]
    tiers = list(changes[0][1]) if changes else []
    lines = [
        f"autoscale ({mode}): replicas over time (s since the replay's start); "
        f"{run['drained']} scale-downs drained, {run['drains_cut']} cut by their deadline",
        f"{'t (s)':>8}  " + "  ".join(f"{t:>7}" for t in tiers),
    ]
    for t, counts in changes:
        lines.append(f"{t:>8.1f}  " + "  ".join(f"{counts[tier]:>7}" for tier in tiers))
    return "\n".join(lines)
