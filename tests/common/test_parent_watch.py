from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from pdd.common.parent_watch import PARENT_PIPE_ENV, ParentPipe, watch_parent

pytestmark = pytest.mark.unit


@pytest.fixture
def sigterm_seen() -> Iterator[threading.Event]:
    """SIGTERM to this process sets the event instead of ending the test run."""
    seen = threading.Event()
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.set())
    yield seen
    signal.signal(signal.SIGTERM, before)


def test_the_parent_gone_sends_sigterm_and_the_child_forgets_the_pipe(
    sigterm_seen: threading.Event,
) -> None:
    read_fd, write_fd = os.pipe()
    os.set_inheritable(read_fd, True)  # as pass_fds leaves it in a child
    environ = {PARENT_PIPE_ENV: str(read_fd), "OTHER": "kept"}
    assert watch_parent(environ)
    assert environ == {"OTHER": "kept"}  # this process's own children watch it, not its parent
    assert not os.get_inheritable(read_fd)
    assert not sigterm_seen.is_set()  # the parent lives: nothing yet
    os.close(write_fd)  # what the kernel does when the parent dies
    assert sigterm_seen.wait(timeout=60)
    os.close(read_fd)


def test_no_pipe_or_a_descriptor_that_is_not_one_watches_nothing(tmp_path) -> None:
    assert not watch_parent({})
    with (tmp_path / "f").open("w") as f:
        assert not watch_parent({PARENT_PIPE_ENV: str(f.fileno())})
    assert not watch_parent({PARENT_PIPE_ENV: "not a number"})


def test_the_parents_pipe_is_made_once_per_process_and_never_inherited() -> None:
    pipe = ParentPipe()
    fd = pipe.read_fd()
    assert pipe.read_fd() == fd
    assert not os.get_inheritable(pipe._write_fd)
