"""A vLLM start stopped by SIGTERM, or failing, leaves nothing on the host: the worker's
processes die and the ipc socket of vLLM's KV events is removed (the worker's own stop,
which removes it otherwise, never runs then). A stand-in start plays vLLM's: a child
process (its engine core) and the socket file, then a wait no signal handler interrupts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.testing.waiting import until_sync
from pdd.worker.vllm.engine_args import VllmEngineSettings
from pdd.worker.vllm.startup import host_files, start_stoppably
from pdd.worker.vllm.worker_config import remove_dead_workers_files

STARTING = """
import asyncio, subprocess, sys, threading
from pathlib import Path
from pdd.worker.vllm.startup import start_stoppably

socket = Path(sys.argv[1])

def start():
    core = subprocess.Popen(["sleep", "600"])  # vLLM's engine core
    socket.write_text("")  # the ipc socket it binds
    print(core.pid, flush=True)
    threading.Event().wait()  # vLLM waiting for its engine core, deaf to signals

asyncio.run(start_stoppably(start, [socket]))
"""


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.integration
def test_sigterm_while_vllm_starts_removes_its_kv_events_socket(tmp_path: Path) -> None:
    socket = tmp_path / f"pdd-vllm-kv-events-{os.getpid()}"
    worker = subprocess.Popen(
        [sys.executable, "-c", STARTING, str(socket)], stdout=subprocess.PIPE, text=True
    )
    try:
        core = int(worker.stdout.readline())
        assert socket.exists()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 128 + signal.SIGTERM
        assert not socket.exists()
        until_sync(lambda: not alive(core), "the stand-in engine core killed")
    finally:
        worker.kill()
        worker.wait()
        worker.stdout.close()


@pytest.mark.unit
async def test_a_failed_start_removes_its_kv_events_socket(tmp_path: Path) -> None:
    socket = tmp_path / "pdd-vllm-kv-events-1"

    def start() -> None:
        socket.write_text("")
        raise RuntimeError("Engine core initialization failed")

    with pytest.raises(RuntimeError, match="initialization failed"):
        await start_stoppably(start, [socket])
    assert not socket.exists()


@pytest.mark.unit
def test_the_host_files_of_a_start_are_its_ipc_socket_only() -> None:
    def settings(endpoint: str | None) -> VllmEngineSettings:
        return VllmEngineSettings(model="/m", kv_events_endpoint=endpoint)

    assert host_files(settings("ipc:///tmp/pdd-vllm-kv-events-7")) == [
        Path("/tmp/pdd-vllm-kv-events-7")
    ]
    assert host_files(settings("tcp://127.0.0.1:5557")) == []
    assert host_files(settings(None)) == []


@pytest.mark.unit
def test_a_start_removes_what_killed_workers_left_on_the_host(tmp_path: Path) -> None:
    """SIGKILL (OOM, a node's kubelet) skips every stop: the socket and the KV store of
    a dead worker stay in the temp folder, one pair per restart, until a start removes
    them; a live worker's (this process's) and other files stay."""
    dead = int(Path("/proc/sys/kernel/pid_max").read_text())  # never a process's ID
    mine = os.getpid()
    for pid in (dead, mine):
        (tmp_path / f"pdd-vllm-kv-events-{pid}").write_text("")
        store = tmp_path / f"pdd-vllm-kv-{pid}" / "req-1"
        store.mkdir(parents=True)
        (store / "chunk-0").write_bytes(b"kv")
    (tmp_path / "pdd-vllm-kv-notes").mkdir()
    removed = remove_dead_workers_files(tmp_path)
    assert sorted(p.name for p in removed) == [f"pdd-vllm-kv-{dead}", f"pdd-vllm-kv-events-{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"pdd-vllm-kv-{mine}",
        f"pdd-vllm-kv-events-{mine}",
        "pdd-vllm-kv-notes",
    ]
