"""Scale-down in the middle of a replay (``pdd bench --scale-down relay,main``).

What an HPA scale-down or ``kubectl scale`` does to a pod, done to the local stack: once a
share of the replay's requests has finished, the newest instance of each named role gets
SIGTERM. The worker drains (it says so on ``/load``, the router stops choosing it, a relay
hands its requests to MD, MD finishes its streams) and exits; the replay goes on with the
instances left. The bench then reports, per mode, what finished, what failed and whether
the greedy outputs still equal the reference mode's: a scale-down that loses nothing shows
0 errors and 0 mismatches.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from pdd.common.vocabulary import Role
from pdd.local.supervisor import Child

#: Roles a scale-down may shrink (mono is the reference, never scaled).
SCALABLE_ROLES = (Role.PREFILL, Role.RELAY, Role.MAIN)


class ScaleDownError(ValueError):
    """A ``--scale-down`` the stack cannot do; the message says what to pass."""


def parse_roles(text: str | None) -> tuple[Role, ...]:
    """``relay,main`` -> (Role.RELAY, Role.MAIN); None or empty: no scale-down."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    allowed = ", ".join(SCALABLE_ROLES)
    bad = [n for n in names if n not in SCALABLE_ROLES]
    if bad:
        raise ScaleDownError(f"--scale-down {text!r}: each role must be one of {allowed}")
    return tuple(dict.fromkeys(Role(n) for n in names))


class Worker(Protocol):
    """What a scale-down needs to know of a worker (a running pod, a worker spec)."""

    @property
    def name(self) -> str: ...
    @property
    def role(self) -> str: ...


W = TypeVar("W", bound=Worker)


def pick_victims(workers: Sequence[W], roles: Sequence[Role]) -> list[W]:
    """The newest instance of each role present in ``workers`` (in start order; an HPA
    removes the newest pod); a role with one instance cannot shrink without leaving the
    mode without it."""
    victims = []
    for role in roles:
        of_role = [w for w in workers if w.role == role]
        if not of_role:
            continue  # this mode has no such role (e.g. naive has no relay)
        if len(of_role) < 2:
            raise ScaleDownError(
                f"--scale-down {role} needs at least 2 {role} workers (pass --{role} 2)"
            )
        victims.append(of_role[-1])
    return victims


@dataclass
class Stopped:
    """One scaled-down worker: when it was told to stop and how it ended."""

    name: str
    role: str
    after_requests: int
    exit_code: int | None = None
    drain_s: float | None = None

    def describe(self) -> str:
        how = (
            f"exited with code {self.exit_code} after {self.drain_s:.1f} s"
            if self.exit_code is not None
            else "had not exited"
        )
        return f"{self.name} ({self.role}) stopped after {self.after_requests} requests, {how}"


@dataclass
class ScaleDown:
    """SIGTERM ``victims`` once ``after`` requests have finished; then wait for them."""

    victims: Sequence[tuple[Worker, Child]]
    after: int
    _finished: int = 0
    _signalled_at: float | None = None
    stopped: list[Stopped] = field(default_factory=list)
    _watchers: list[threading.Thread] = field(default_factory=list)

    def on_outcome(self) -> None:
        """Count one finished request; the ``after``-th one triggers the scale-down."""
        self._finished += 1
        if self._signalled_at is None and self._finished >= self.after and self.victims:
            self._signalled_at = time.monotonic()
            for spec, child in self.victims:
                child.proc.send_signal(signal.SIGTERM)
                record = Stopped(spec.name, spec.role, self._finished)
                self.stopped.append(record)
                watcher = threading.Thread(
                    target=self._watch, args=(child.proc, record), daemon=True
                )
                self._watchers.append(watcher)
                watcher.start()

    def _watch(self, proc: subprocess.Popen, record: Stopped) -> None:
        """Note when the drained process exits (its drain time) and how."""
        code = proc.wait()
        record.drain_s = time.monotonic() - (self._signalled_at or 0.0)
        record.exit_code = code

    @property
    def names(self) -> set[str]:
        return {spec.name for spec, _ in self.victims}

    def wait(self, timeout_s: float) -> list[Stopped]:
        """Each victim's exit code and drain time (None: still running ``timeout_s`` after
        the signal)."""
        if self._signalled_at is None:
            return []
        deadline = self._signalled_at + timeout_s
        for watcher in self._watchers:
            watcher.join(max(0.0, deadline - time.monotonic()))
        return self.stopped
