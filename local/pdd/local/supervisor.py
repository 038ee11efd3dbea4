"""Child processes of ``pdd up`` and of the local clusters tests and benchmarks start
(``cluster.LocalCluster``): watched while they run, all stopped on the way out.

A child that exits on its own is a fault the user must hear about (with the tail of
its log), never a silent gap. ``stop`` sends SIGTERM to every child still alive,
waits, and SIGKILLs stragglers, so nothing outlives the supervisor; and a supervisor
killed before it could stop them (SIGKILL, the OOM killer) still takes them with it:
each child watches this process's parent pipe (``pdd.common.parent_watch``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdd.common.parent_watch import PARENT_PIPE_ENV, ParentPipe


@dataclass
class _StopSignals:
    """Whether a stop signal must wait (``held`` deep), and whether one arrived then."""

    held: int = 0
    arrived: bool = False


_STOP = _StopSignals()


@contextlib.contextmanager
def interrupted_by_stop_signals() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM raise KeyboardInterrupt, so the caller's cleanup (its
    children stopped) runs however the command is stopped; Python's default for SIGTERM
    exits without it and leaves the children running. SIGINT too: a shell starts
    background jobs with SIGINT ignored, and Python keeps that. The handlers before are
    put back on the way out (signals are the process's; only the main thread sets them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stops = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, _interrupt) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """A stop signal arriving inside interrupts only on the way out (where
    ``interrupted_by_stop_signals`` is in force: ``pdd up``, ``pdd bench``). Starting a
    child is such a section: interrupted between the fork and the child's entry in the
    supervisor's list, the child would run on with nobody to stop it."""
    _STOP.held += 1
    try:
        yield
    finally:
        _STOP.held -= 1
        if not _STOP.held and _STOP.arrived:  # also past an error of the section's own
            _STOP.arrived = False
            raise KeyboardInterrupt


def _interrupt(signum: int, frame: object) -> None:
    if _STOP.held:
        _STOP.arrived = True
        return
    raise KeyboardInterrupt


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    #: What it was started with beside this process's environment; ``restart`` uses it.
    env: Mapping[str, str] = field(default_factory=dict)

    def restart(self) -> None:
        """Start it again as it was started (same command line, so the same ports and
        instance id; same environment), its output appended to its log: what a
        Deployment does for a pod whose container died."""
        if self.proc.poll() is None:
            raise RuntimeError(f"{self.name} (pid {self.proc.pid}) is still running")
        argv = [str(a) for a in self.proc.args]  # type: ignore[union-attr]  # a list here
        with stop_signals_held():
            self.proc = spawn_process(argv, self.log, self.env, append=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class Death:
    child: Child
    returncode: int

    def describe(self) -> str:
        return (
            f"{self.child.name} (pid {self.child.proc.pid}) exited with code {self.returncode}; "
            f"log {self.child.log}:\n{self.child.log_tail()}"
        )


#: ``pdd`` as this interpreter runs it (the console script may not be on PATH).
PDD_PROGRAM = (sys.executable, "-m", "pdd.cli")


#: This process's end of the pipe its children watch, so they stop when it dies.
_PARENT_PIPE = ParentPipe()


def spawn_process(
    argv: Sequence[str], log: Path, env: Mapping[str, str], append: bool = False
) -> subprocess.Popen:
    """``argv`` with this environment plus ``env``, stdout and stderr into ``log``
    (after what it holds, with ``append``); a ``pdd`` command among them stops when this
    process dies."""
    pipe = _PARENT_PIPE.read_fd()
    with log.open("ab" if append else "wb") as out:
        return subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, PARENT_PIPE_ENV: str(pipe)},
            pass_fds=(pipe,),
        )


def spawn_pdd(argv: Sequence[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen:
    """``pdd <argv>`` in this interpreter, stdout and stderr into ``log``."""
    return spawn_process([*PDD_PROGRAM, *argv], log, env)


@dataclass
class Supervisor:
    children: list[Child] = field(default_factory=list)
    _reported: set[int] = field(default_factory=set)
    #: Children told to stop on their own (a scale-down's drain): their exit is no death.
    _retiring: set[str] = field(default_factory=set)

    def add(
        self, name: str, proc: subprocess.Popen, log: Path, env: Mapping[str, str] | None = None
    ) -> Child:
        """Watch ``proc``; ``env`` is what it was spawned with, for a ``restart``."""
        child = Child(name, proc, log, dict(env or {}))
        self.children.append(child)
        return child

    def spawn(
        self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str], append: bool
    ) -> Child:
        """Start ``argv`` (as ``spawn_process``) and watch it; a stop signal arriving
        meanwhile acts once it is watched, so the stop that follows reaches it."""
        with stop_signals_held():
            return self.add(name, spawn_process(argv, log, env, append), log, env)

    def deaths(self) -> list[Death]:
        """Children that exited since the last call (each reported once)."""
        found = []
        for child in self.children:
            if child.name in self._retiring:
                continue
            code = child.proc.poll()
            if code is not None and child.proc.pid not in self._reported:
                self._reported.add(child.proc.pid)
                found.append(Death(child, code))
        return found

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children}

    def stop(self, grace_s: float = 10.0, names: Collection[str] | None = None) -> None:
        """SIGTERM everyone alive (or those of the children ``names`` lists), wait up to
        ``grace_s`` in all, then SIGKILL the rest."""
        chosen = [c for c in self.children if names is None or c.name in names]
        alive = [c.proc for c in chosen if c.proc.poll() is None]
        for proc in alive:
            proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in alive:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def forget(self, names: Collection[str]) -> None:
        """Stop watching the children ``names`` lists (stopped, to be started anew)."""
        self.children = [c for c in self.children if c.name not in names]
        self._retiring -= set(names)

    def retire(self, name: str) -> None:
        """SIGTERM the child ``name`` (a worker then drains: it finishes what it holds and
        exits) without waiting; its exit is expected, so ``deaths`` never reports it and
        ``retired`` does."""
        child = next(c for c in self.children if c.name == name)
        self._retiring.add(name)
        if child.proc.poll() is None:
            child.proc.terminate()

    def retiring(self) -> frozenset[str]:
        """The children retired that have not exited yet."""
        return frozenset(self._retiring)

    def retired(self) -> list[Death]:
        """Retired children that have exited since the last call, with their exit codes;
        each is forgotten (its name may be started anew)."""
        done = [
            Death(c, code)
            for c in self.children
            if c.name in self._retiring and (code := c.proc.poll()) is not None
        ]
        self.forget({d.child.name for d in done})
        return done


def wait_ready(
    checks: dict[str, Callable[[], bool]],
    supervisor: Supervisor,
    deadline: float,
    log_dir: Path,
    error: type[Exception],
) -> None:
    """Poll every named readiness check until all pass; a child that dies meanwhile, or
    a deadline that passes first, is an ``error`` naming it (and where its log is)."""
    while checks:
        for death in supervisor.deaths():
            raise error(death.describe())
        checks = {name: check for name, check in checks.items() if not check()}
        if checks and time.monotonic() > deadline:
            raise error(f"not ready in time: {', '.join(checks)} (logs in {log_dir})")
        if checks:
            time.sleep(0.2)
