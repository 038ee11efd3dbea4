"""Client keys from a key file or ``$PDD_API_KEYS``: none needs a command line.

``--api-key K`` shows the key to every user in ``ps``; ``--api-key-file PATH`` and the
environment do not. Each way, the real app (in process) answers 401 without the key and
200 with it; a key file that cannot be read, or holds no key, stops the router (exit 2,
the file named) rather than leaving it open.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pdd.common.config_document import API_KEYS_ENV
from pdd.router.app import create_app
from pdd.router.runtime import RouterRuntime
from pdd.router.server import build_config, build_parser, main

pytestmark = pytest.mark.unit

WORKER = ("--mono", "m=http://127.0.0.1:1", "--secret", "s")


async def models_status(argv: list[str], key: str | None) -> int:
    config = build_config(build_parser().parse_args([*WORKER, *argv]))
    app = create_app(RouterRuntime(config))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://router", headers=headers
    ) as client:
        return (await client.get("/v1/models")).status_code


async def test_a_key_file_holds_the_keys_one_per_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-first\n\n  sk-second  \n")
    argv = ["--api-key-file", str(keys)]
    assert build_config(build_parser().parse_args([*WORKER, *argv])).api_keys == (
        "sk-first",
        "sk-second",
    )
    assert await models_status(argv, None) == 401
    assert await models_status(argv, "sk-wrong") == 401
    assert await models_status(argv, "sk-second") == 200


async def test_the_environment_holds_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, "sk-env")
    assert await models_status([], None) == 401
    assert await models_status([], "sk-env") == 200


@pytest.mark.parametrize(("content", "says"), [("", "holds no key"), (None, "cannot read it")])
def test_a_key_file_without_keys_stops_the_router_naming_it(
    content: str | None, says: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys"
    if content is not None:
        keys.write_text(content)
    assert main([*WORKER, "--api-key-file", str(keys)]) == 2
    assert f"--api-key-file {keys}" in caplog.text and says in caplog.text
