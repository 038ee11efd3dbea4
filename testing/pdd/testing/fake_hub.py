"""A Hugging Face Hub stand-in over local HTTP, for tests of pulls (no network).

Serves folders ``ROOT/ORG/NAME`` as model repos at one revision, speaking the few
endpoints ``huggingface_hub.snapshot_download`` calls: the repo info
(``/api/models/ORG/NAME[/revision/REV]``), the file tree
(``/api/models/ORG/NAME/tree/SHA``) and the files (``/ORG/NAME/resolve/SHA/PATH``,
HEAD and GET with Range, so a cut download resumes). With a token set, any other
token is refused as the Hub refuses one (401, "Invalid credentials"); a missing repo or
revision gets the Hub's error codes. Point ``HF_ENDPOINT`` at ``url``.

    python -m pdd.testing.fake_hub --root DIR --port 8112 [--token SECRET]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

REVISION = "main"


class FakeHub:
    """The server; ``start()`` serves on a thread, ``stop()`` ends it."""

    def __init__(self, root: Path, token: str | None = None, port: int = 0) -> None:
        self.root = root
        self.token = token
        self.requests: list[str] = []  # "METHOD path", for tests that check what was asked
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeHub:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def repo_dir(self, repo: str) -> Path | None:
        path = self.root / repo
        return path if path.is_dir() and len(repo.split("/")) == 2 else None

    def commit(self, repo: str) -> str:
        """A stable 40-hex commit id for the repo's current files."""
        digest = hashlib.sha1(repo.encode())
        for path in sorted(self._files(repo)):
            digest.update(path.encode())
            digest.update(str((self.root / repo / path).stat().st_size).encode())
        return digest.hexdigest()

    def _files(self, repo: str) -> list[str]:
        base = self.root / repo
        return [str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            if hub.token is not None and self.headers.get("authorization") != f"Bearer {hub.token}":
                return self._error(401, message="Invalid credentials in Authorization header")
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api(f"{parts[2]}/{parts[3]}", parts[4:])
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._file(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), body)
            return self._error(404, code="EntryNotFound")

        def _api(self, repo: str, rest: list[str]) -> None:
            if hub.repo_dir(repo) is None:
                return self._error(404, code="RepoNotFound")
            sha = hub.commit(repo)
            if rest[:1] in (["revision"], ["tree"]) and rest[1:2] not in ([REVISION], [sha]):
                return self._error(404, code="RevisionNotFound")
            files = sorted(hub._files(repo))
            if rest[:1] == ["tree"]:
                tree = [{"type": "file", "oid": _oid(hub.root / repo / f), "path": f,
                         "size": (hub.root / repo / f).stat().st_size} for f in files]  # fmt: skip
                return self._json(tree)
            return self._json({"id": repo, "modelId": repo, "sha": sha, "private": False,
                               "siblings": [{"rfilename": f} for f in files]})  # fmt: skip

        def _file(self, repo: str, revision: str, name: str, body: bool) -> None:
            base = hub.repo_dir(repo)
            if base is None:
                return self._error(404, code="RepoNotFound")
            if revision not in (REVISION, hub.commit(repo)):
                return self._error(404, code="RevisionNotFound")
            path = base / name
            if not path.is_file():
                return self._error(404, code="EntryNotFound")
            data = path.read_bytes()
            start = _range_start(self.headers.get("range"))
            status = 206 if start else 200
            self.send_response(status)
            self.send_header("X-Repo-Commit", hub.commit(repo))
            self.send_header("ETag", f'"{_oid(path)}"')
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if body:
                self.wfile.write(data[start:])

        def _json(self, data: Any) -> None:
            blob = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(blob)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(blob)

        def _error(self, status: int, code: str | None = None, message: str | None = None) -> None:
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            if message:
                self.send_header("X-Error-Message", message)
            blob = json.dumps({"error": message or code}).encode()
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(blob)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(blob)

    return Handler


def _oid(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def _range_start(header: str | None) -> int:
    if not header or not header.startswith("bytes="):
        return 0
    return int(header.removeprefix("bytes=").split("-")[0] or 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdd.testing.fake_hub")
    p.add_argument("--root", type=Path, required=True, help="folders ORG/NAME served as repos")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token", help="the one token accepted (default: any, or none)")
    args = p.parse_args(argv)
    hub = FakeHub(args.root, args.token, args.port)
    print(f"fake hub on {hub.url}", flush=True)
    hub.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
