from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdd.local.supervisor import Supervisor, interrupted_by_stop_signals, stop_signals_held
from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration


#: A child that runs until a signal ends it (no timer of its own).
UNTIL_STOPPED = "import signal\nwhile True: signal.pause()\n"


def python(code: str, log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture
def sup() -> Iterator[Supervisor]:
    """A supervisor whose children are stopped after the test, whatever it asserted."""
    supervisor = Supervisor()
    yield supervisor
    supervisor.stop(grace_s=5.0)


def wait_exit(proc: subprocess.Popen) -> None:
    proc.wait(timeout=30)


def test_a_dead_child_is_reported_once_with_its_log(sup: Supervisor, tmp_path: Path) -> None:
    dying = sup.add("md0", python("print('cuda? no'); raise SystemExit(3)", tmp_path / "a"),
                    tmp_path / "a")  # fmt: skip
    sup.add("p0", python(UNTIL_STOPPED, tmp_path / "b"), tmp_path / "b")
    wait_exit(dying.proc)
    (death,) = sup.deaths()
    assert death.child.name == "md0" and death.returncode == 3
    assert "cuda? no" in death.describe() and "code 3" in death.describe()
    assert sup.deaths() == []
    sup.stop()
    assert all(c.proc.poll() is not None for c in sup.children)


def test_stop_kills_a_child_that_ignores_sigterm(sup: Supervisor, tmp_path: Path) -> None:
    code = (
        "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('armed', flush=True)\n"
    ) + UNTIL_STOPPED
    child = sup.add("stubborn", python(code, tmp_path / "s"), tmp_path / "s")
    until_sync(lambda: "armed" in child.log_tail(), "the child to ignore SIGTERM")
    sup.stop(grace_s=0.5)
    assert child.proc.returncode == -9


def test_stop_by_name_stops_only_those_and_forget_lets_them_go(
    sup: Supervisor, tmp_path: Path
) -> None:
    """What a local cluster does with a worker that lost its port: stop it and its link,
    forget them, and start them anew; the other children run on."""
    for name in ("md0", "md0-wan-link", "p0"):
        sup.add(name, python(UNTIL_STOPPED, tmp_path / name), tmp_path / name)
    sup.stop(names={"md0", "md0-wan-link"})
    stopped = {c.name: c.proc.poll() is not None for c in sup.children}
    assert stopped == {"md0": True, "md0-wan-link": True, "p0": False}
    sup.forget({"md0", "md0-wan-link"})
    assert [c.name for c in sup.children] == ["p0"]
    sup.stop()
    assert sup.children[0].proc.poll() is not None


def test_a_stop_signal_inside_a_held_section_interrupts_on_its_way_out() -> None:
    """Starting a child is held: interrupted between its fork and its entry in the
    supervisor's list, nobody would stop it. The signal is not lost, only delayed."""
    reached, before = [], signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), interrupted_by_stop_signals():
        with stop_signals_held():
            signal.raise_signal(signal.SIGTERM)
            reached.append("after the signal")
        reached.append("after the section")
    assert reached == ["after the signal"]
    assert signal.getsignal(signal.SIGTERM) == before  # put back as it was


def test_outside_a_held_section_a_stop_signal_interrupts_at_once() -> None:
    with pytest.raises(KeyboardInterrupt), interrupted_by_stop_signals():
        signal.raise_signal(signal.SIGTERM)
        pytest.fail("not interrupted")


def test_a_stop_signal_held_through_a_failed_start_is_not_lost() -> None:
    """The section's own error (a child that could not start) must not swallow it."""
    with pytest.raises(KeyboardInterrupt), interrupted_by_stop_signals(), stop_signals_held():
        signal.raise_signal(signal.SIGTERM)
        raise OSError("no such program")


#: A supervisor's process: starts one ``pdd wan-link`` (a real pdd command) as pdd up
#: starts its children, says its pid, then waits to be killed.
PARENT = """
import signal, sys
from pathlib import Path
from pdd.local.supervisor import spawn_pdd
argv = ["wan-link", "--listen", "127.0.0.1:0", "--to", "127.0.0.1:9", "--link-gbps", "1"]
child = spawn_pdd(argv, Path(sys.argv[1]), {})
print(child.pid, flush=True)
while True: signal.pause()
"""


def alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's zombie waits for whoever reaps for init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_children_stop_when_their_supervisor_is_killed_outright(tmp_path: Path) -> None:
    log = tmp_path / "wan-link.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(log)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        until_sync(lambda: log.exists() and log.stat().st_size > 0, "the wan-link to log")
        assert alive(child)
        parent.kill()  # SIGKILL: no cleanup of its own runs, as under the OOM killer
        parent.wait(timeout=30)
        until_sync(lambda: not alive(child), "the orphaned child to stop")
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
