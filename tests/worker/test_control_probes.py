"""The control API's Kubernetes probes: each answers its own question."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from pdd.worker.control_api import create_app

pytestmark = pytest.mark.unit


async def probe_statuses(role: Any, ready: bool) -> dict[str, int]:
    app = create_app(role, feed=None, ready=lambda: ready)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        return {p: (await client.get(p)).status_code for p in ("/startup", "/live", "/ready")}


async def test_a_draining_worker_is_unready_but_live_and_a_dead_engine_is_not_live() -> None:
    runner = SimpleNamespace(alive=True)
    role = SimpleNamespace(role="main", settings=SimpleNamespace(secret="s"), runner=runner)
    assert await probe_statuses(role, ready=True) == {"/startup": 200, "/live": 200, "/ready": 200}
    # A drain: out of the Service, never restarted for it (it is finishing its streams).
    assert await probe_statuses(role, ready=False) == {"/startup": 200, "/live": 200,
                                                        "/ready": 503}  # fmt: skip
    runner.alive = False  # the engine's driver died: only a restart helps
    assert (await probe_statuses(role, ready=True))["/live"] == 503
