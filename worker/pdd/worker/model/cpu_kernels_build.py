"""Build a shared library once into a cache that many processes share, never blocking on
a builder that died, never retrying a build that failed.

Why not ``torch.utils.cpp_extension.load``: it builds in the cache directory itself
under a ``lock`` *file* whose mere presence makes every other process wait, forever,
if its owner was interrupted (Ctrl-C on ``pdd up``, a pod killed mid-build), and a
process that finds the half-built directory can try to load a library that is not
there yet. It also retries a failed build in every process and puts the compiler's
output in its exception, which ends up in every log.

Here, for a target ``<root>/<name>``:

* ``<name>.so`` is only ever created by an atomic rename of a finished build from a
  private directory (``<name>.build-<pid>``), so whoever sees it sees all of it;
* ``<name>.lock`` is held with an OS file lock (``flock``) while building: the kernel
  drops it when its owner exits, however it exits, so a dead builder never blocks
  anyone; a live one makes others wait at most ``wait_s``, after which they go on
  without the library;
* ``<name>.failed`` records a failed build (JSON: the problem, the log), so no later
  process tries again until someone deletes it;
* ``<name>.log`` holds the compiler's output; nothing else shows it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a waiter looks at the lock again


@dataclass(frozen=True)
class Outcome:
    """What ``build_once`` got: the library, or why there is none (one line)."""

    library: Path | None
    problem: str | None
    log: Path
    built_now: bool = False  # this call compiled it (rather than finding it cached)


@dataclass(frozen=True)
class Target:
    """The cache entries of one build: ``<root>/<name>`` plus a suffix each."""

    root: Path
    name: str

    @property
    def library(self) -> Path:
        return self.root / f"{self.name}.so"

    @property
    def failure(self) -> Path:
        return self.root / f"{self.name}.failed"

    @property
    def lock(self) -> Path:
        return self.root / f"{self.name}.lock"

    @property
    def log(self) -> Path:
        return self.root / f"{self.name}.log"

    def private_dir(self) -> Path:
        return self.root / f"{self.name}.build-{os.getpid()}"

    def leftovers(self) -> list[Path]:
        """Private directories of earlier builders (only the lock holder calls this, so
        none of them is still being written)."""
        return sorted(self.root.glob(f"{self.name}.build-*"))


def cached(target: Target) -> Outcome | None:
    """What the cache already says about ``target``: built, failed, or None (neither)."""
    if target.failure.exists():
        return Outcome(None, _recorded_problem(target), target.log)
    if target.library.exists():
        return Outcome(target.library, None, target.log)
    return None


def build_once(target: Target, command: Callable[[Path], list[str]], wait_s: float) -> Outcome:
    """The library of ``target``, built by ``command(output_path)`` if no process has
    built (or failed to build) it yet; waits at most ``wait_s`` for a live builder."""
    found = cached(target)
    if found is not None:
        return found
    target.root.mkdir(parents=True, exist_ok=True)
    with _exclusive(target, wait_s) as holding:
        if not holding:
            return Outcome(
                None,
                f"another process has held {target.lock} for over {wait_s:.0f} s "
                "(still building?); not waiting longer",
                target.log,
            )
        found = cached(target)  # the process we waited for may have finished it
        if found is not None:
            return found
        return _build(target, command)


@contextlib.contextmanager
def _exclusive(target: Target, wait_s: float) -> Iterator[bool]:
    """Hold ``target``'s lock (yield True), or yield False after ``wait_s`` of waiting."""
    fd = os.open(target.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    log.info(
                        "waiting for another process building %s (%s)", target.name, _owner(fd)
                    )
                    said = True
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for a person looking; not relied on
        yield True
    finally:
        os.close(fd)  # releases the lock, as the process's death would


def _owner(fd: int) -> str:
    pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return f"pid {pid}" if pid else "pid unknown"


def _build(target: Target, command: Callable[[Path], list[str]]) -> Outcome:
    """Compile into a private directory, then rename the library into the cache."""
    for leftover in target.leftovers():  # from builders killed before their cleanup
        shutil.rmtree(leftover, ignore_errors=True)
    private = target.private_dir()
    private.mkdir()
    try:
        output = private / target.library.name
        argv = command(output)
        with (private / target.log.name).open("w") as out:
            out.write(" ".join(argv) + "\n\n")
            out.flush()
            try:
                # The lock's descriptor is close-on-exec: a compiler left running by a
                # killed builder cannot keep holding it.
                done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
                problem = (
                    None if done.returncode == 0 else f"the compiler exited with {done.returncode}"
                )
            except OSError as exc:  # no compiler at that path, not executable, ...
                out.write(f"{exc}\n")
                problem = f"cannot run the compiler {argv[0]!r} ({exc.strerror or exc})"
        os.replace(private / target.log.name, target.log)
        if problem is None and not output.exists():
            problem = "the compiler exited with 0 but wrote no library"
        if problem is not None:
            record_failure(target, problem)
            return Outcome(None, problem, target.log, built_now=True)
        os.replace(output, target.library)
        return Outcome(target.library, None, target.log, built_now=True)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def record_failure(target: Target, problem: str) -> None:
    """Write ``target``'s failure record atomically (a reader sees all of it or none)."""
    partial = target.root / f"{target.name}.failed.{os.getpid()}"
    partial.write_text(json.dumps({"problem": problem, "log": str(target.log)}) + "\n")
    os.replace(partial, target.failure)


def _recorded_problem(target: Target) -> str:
    try:
        return str(json.loads(target.failure.read_text())["problem"])
    except (OSError, ValueError, KeyError, TypeError):
        return "an earlier build failed"
