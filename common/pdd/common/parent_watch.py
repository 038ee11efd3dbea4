"""A child process that stops when the process that started it dies, however it died.

``pdd up``, ``pdd bench`` and the local clusters tests start stop their children on the
way out, but a parent killed outright (SIGKILL, the kernel's OOM killer) runs no cleanup,
and its children would run on, reparented to init, holding ports, memory and cores.
``PR_SET_PDEATHSIG`` is no answer where the parent has threads: it fires when the
*thread* that forked exits, and the supervisor may start children from any thread.

So the parent makes one pipe and keeps its write end to itself; each child inherits only
the read end, named in ``$PDD_PARENT_PIPE_FD``. No one ever writes on it: the read
returns (end of file) exactly when the last holder of the write end, the parent, is gone,
and the child then sends itself SIGTERM, the signal a pod gets, so a worker drains as it
would on a scale-down.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
from collections.abc import MutableMapping

#: The environment variable naming the pipe's read end in a child.
PARENT_PIPE_ENV = "PDD_PARENT_PIPE_FD"


class ParentPipe:
    """The parent's side: one pipe per process, made on first use (and made again in a
    forked copy of the process, whose own death must be what its children watch)."""

    def __init__(self) -> None:
        self._pid = -1
        self._read_fd = -1
        self._write_fd = -1
        self._lock = threading.Lock()

    def read_fd(self) -> int:
        """The read end to pass to a child (``pass_fds``); the write end stays here, never
        inherited (PEP 446), for as long as this process lives."""
        with self._lock:
            if self._pid != os.getpid():
                self._read_fd, self._write_fd = os.pipe()
                self._pid = os.getpid()
            return self._read_fd


def watch_parent(environ: MutableMapping[str, str] = os.environ) -> bool:
    """In a child started with a parent pipe: SIGTERM to this process once the parent is
    gone. The variable leaves the environment and the descriptor is not inherited, so this
    process's own children watch it, not its parent. False where no pipe was given."""
    text = environ.pop(PARENT_PIPE_ENV, None)
    if text is None:
        return False
    try:
        fd = int(text)
        is_pipe = stat.S_ISFIFO(os.fstat(fd).st_mode)
    except (ValueError, OSError):  # not a descriptor this process holds: nothing to watch
        return False
    if not is_pipe:  # the name came through something that did not pass the descriptor
        return False
    os.set_inheritable(fd, False)
    threading.Thread(target=_wait_for_parent, args=(fd,), name="parent-watch", daemon=True).start()
    return True


def _wait_for_parent(fd: int) -> None:
    try:
        while os.read(fd, 1):  # nobody writes: only end of file (the parent gone) returns
            pass
    except OSError:  # the descriptor was closed under us: that says nothing of the parent
        return
    os.kill(os.getpid(), signal.SIGTERM)
