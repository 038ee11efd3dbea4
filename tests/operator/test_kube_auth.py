"""The operator's client against a live (tiny) API server: an exec plugin's credential is
renewed when the server refuses it, or before it expires, by running the plugin again."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from pdd.operator.kube import KubeApi, ObjectPath

pytestmark = pytest.mark.integration

PLUGIN = """#!{python}
import json, pathlib
runs = pathlib.Path({runs!r})
count = len(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text("x" * count)
status = {{"token": f"token-{{count}}"}}
if {expiry!r}:
    status["expirationTimestamp"] = {expiry!r}
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1beta1",
                  "kind": "ExecCredential", "status": status}}))
"""


async def api_server(accepted: set[str]) -> tuple[web.AppRunner, str, list[str]]:
    """An API server that answers GETs for tokens in ``accepted`` and 401 to others."""
    seen: list[str] = []

    async def get(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        seen.append(auth)
        if auth.removeprefix("Bearer ") not in accepted:
            return web.json_response({"kind": "Status", "message": "Unauthorized"}, status=401)
        return web.json_response({"kind": "ConfigMap", "metadata": {"name": "c"}})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns/configmaps/c", get)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", seen


async def client(tmp_path: Path, url: str, expiry: str = "") -> tuple[KubeApi, Path]:
    runs, plugin = tmp_path / "runs", tmp_path / "plugin"
    plugin.write_text(PLUGIN.format(python=sys.executable, runs=str(runs), expiry=expiry))
    plugin.chmod(0o755)
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1",
                     "command": str(plugin)}}  # fmt: skip
    config = {
        "current-context": "b",
        "contexts": [{"name": "b", "context": {"cluster": "b", "user": "u"}}],
        "clusters": [{"name": "b", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": user}],
    }
    return await KubeApi.from_kubeconfig(yaml.safe_load(json.dumps(config))), runs


async def test_a_refused_exec_credential_is_renewed_once_and_the_call_retried(
    tmp_path: Path,
) -> None:
    runner, url, seen = await api_server(accepted={"token-2"})
    api, runs = await client(tmp_path, url)
    try:
        got = await api.get(ObjectPath("ConfigMap", "ns", "c"))
        assert got is not None and got["metadata"]["name"] == "c"
        assert seen == ["Bearer token-1", "Bearer token-2"] and runs.read_text() == "xx"
        await api.get(ObjectPath("ConfigMap", "ns", "c"))  # kept while the server takes it
        assert runs.read_text() == "xx"
    finally:
        await api.aclose()
        await runner.cleanup()


async def test_an_expired_exec_credential_is_renewed_before_the_request(tmp_path: Path) -> None:
    runner, url, seen = await api_server(accepted={"token-1", "token-2"})
    past = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=1)).isoformat()
    api, runs = await client(tmp_path, url, expiry=past.replace("+00:00", "Z"))
    try:
        await api.get(ObjectPath("ConfigMap", "ns", "c"))
        assert seen == ["Bearer token-2"] and runs.read_text() == "xx"  # token-1 had expired
    finally:
        await api.aclose()
        await runner.cleanup()
