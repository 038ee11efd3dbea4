"""Test tiers, checked: every test is exactly one of unit, integration, slow or e2e.

- ``unit``: no processes, no sockets (enforced below); the inner loop, ``-m unit``.
- ``integration``: real processes and loopback sockets (workers, routers, Redis, kmock).
- ``slow``: long suites (datacenter-scale simulations); CI runs them too.
- ``e2e``: a real Kubernetes cluster through kind and Docker (skipped without them).

A module declares its tier with ``pytestmark``; a test without exactly one tier is a
collection error, so a new test cannot silently land in no tier or in two.

Tests marked ``virtual_clock`` run on an event loop whose time is virtual
(``pdd.testing.virtual_time``): timeouts and delays cost nothing and fire in a
fixed order, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing.process
import socket
import subprocess
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from pdd.testing.virtual_time import VirtualClock, new_event_loop

TIERS = ("unit", "integration", "slow", "e2e")


def pytest_configure(config: pytest.Config) -> None:
    """Build matplotlib's font cache before any test: on a machine's first run it runs
    ``fc-list`` where fontconfig is installed, and a unit test that draws a plot would
    start that process itself (``TierViolation``). Later runs read the cache."""
    with contextlib.suppress(ImportError):
        importlib.import_module("matplotlib.font_manager")


@pytest.hookimpl(trylast=True)  # after pytest-randomly has shuffled them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _check_tiers(items)
    # Longest first: with parallel workers the slow tier then overlaps everything else
    # instead of starting last (a stable sort: the shuffled order stays within each part).
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _check_tiers(items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers()} & set(TIERS))
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {tiers or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            "every test needs exactly one tier marker of " + ", ".join(TIERS)
            + " (set pytestmark in the module):\n  " + "\n  ".join(wrong[:20])
        )  # fmt: skip


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """``virtual_clock`` tests get a virtual-time loop; every other test asyncio's own."""
    if item.get_closest_marker("virtual_clock") is not None:
        return {"virtual_clock": lambda: new_event_loop(VirtualClock())}
    return {"asyncio": asyncio.new_event_loop}


class TierViolation(RuntimeError):
    """A unit test opened a socket or started a process."""


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TierViolation(
            f"a unit test may not {what}: use the in-memory network / in-process parts, "
            "or mark the module pytest.mark.integration"
        )

    return refuse


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """Inside a ``unit`` test, inet sockets and child processes raise ``TierViolation``."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    real_connect, real_bind = socket.socket.connect, socket.socket.bind

    def guarded(real: Callable[..., Any], what: str) -> Callable[..., Any]:
        def call(sock: socket.socket, address: Any) -> Any:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                _refuse(what)()
            return real(sock, address)

        return call

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", guarded(real_connect, "open a network connection"))
        patch.setattr(socket.socket, "bind", guarded(real_bind, "listen on a network port"))
        patch.setattr(subprocess.Popen, "__init__", _refuse("start a process"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("start a process"))
        yield
