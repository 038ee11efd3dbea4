"""The unit tier is kept honest: a unit test cannot open a network socket or start a process."""

from __future__ import annotations

import asyncio
import socket
import subprocess

import pytest

pytestmark = pytest.mark.unit


def test_a_unit_test_cannot_reach_the_network_or_start_a_process() -> None:
    with pytest.raises(RuntimeError, match="unit test may not open a network connection"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    with pytest.raises(RuntimeError, match="unit test may not listen on a network port"):
        asyncio.run(asyncio.start_server(lambda r, w: None, "127.0.0.1", 0))
    with pytest.raises(RuntimeError, match="unit test may not start a process"):
        subprocess.run(["true"], check=False)


def test_local_socket_pairs_stay_allowed() -> None:
    """asyncio's event loop wakes itself through one (and the in-memory network needs none)."""
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"x")
        assert right.recv(1) == b"x"
