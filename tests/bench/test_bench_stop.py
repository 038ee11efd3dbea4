"""``pdd bench`` stopped while it brings a stack up leaves no process behind.

Python's default for SIGTERM exits at once, without the bench's cleanup: the WAN
link emulators and workers it had started kept running. The signal is sent as soon as
the stack's link emulators are up, while the bench still waits for the workers to load
(a replay of 100 requests at the trace's own pace follows, so the bench is never done
by then, however fast the machine).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.testing.processes import process_group_members
from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_bench_stopped_mid_start_stops_every_process_it_started(
    tmp_path: Path, stop: signal.Signals
) -> None:
    # -X faulthandler: a bench that does not stop is sent SIGABRT, which prints where each
    # of its threads is (this test once found a bench that never stopped, never since).
    argv = [sys.executable, "-X", "faulthandler", "-m", "pdd.cli", "bench", "--model", "tiny",
            "--modes", "pdd", "--max-requests", "100", "--time-scale", "1",
            "--out-dir", str(tmp_path), "--no-plots", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        until_sync(lambda: _running(proc.pid, b"wan-link"), "the stack's link emulators")
        proc.send_signal(stop)
        stderr = _stderr_once_exited(proc)
        left = process_group_members(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever is left, not past the test
            os.killpg(proc.pid, signal.SIGKILL)
    assert left == []
    assert "pdd bench: stopped; every process it started is stopped" in stderr
    # 130 as returned; the interpreter now and then ends the process by SIGINT instead
    # (no traceback, the message above printed), after SIGTERM too, which the bench turns
    # into the same KeyboardInterrupt (``interrupted_by_stop_signals``): a shell reads
    # both as "interrupted".
    assert proc.returncode in {130, -signal.SIGINT}


def _stderr_once_exited(proc: subprocess.Popen) -> str:
    """The bench's stderr once it exited; failing with its threads' stacks where it has
    not within 120 s."""
    try:
        return proc.communicate(timeout=120)[1]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, stderr = proc.communicate(timeout=60)
        pytest.fail(f"the bench did not stop in 120 s; its stderr and threads:\n{stderr[-8000:]}")


def _running(pgid: int, name: bytes) -> bool:
    """Whether a process of group ``pgid`` has ``name`` in its command line."""
    for pid in process_group_members(pgid):
        try:
            if name in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:  # gone meanwhile
            continue
    return False
