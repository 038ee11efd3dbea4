"""The router's spans survive its stop (issue 58): SIGTERM, as ``pdd up`` and Kubernetes
stop it, exports what the batch processor still holds before the process ends.

uvicorn re-raises the stop signal once it has shut down, so the process ends by the
signal's default action and no exit hook runs: the spans of the last batch window (up to
5 s of requests, all of a short ``pdd up`` session) were lost unless the app's shutdown
exports them itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration


def request_spans(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [
        span
        for line in path.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
        if span["name"] == "pdd.request"
    ]


def test_a_stopped_router_has_exported_its_last_requests_spans(
    start_router, tmp_path: Path
) -> None:
    traces = tmp_path / "traces.jsonl"
    nowhere = "--mono", "m0=http://127.0.0.1:9"  # a worker that never answers
    router = start_router(*nowhere, "--traces-file", str(traces), ready=False)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 503, answer.text  # no worker: the span is there all the same
    router.proc.terminate()
    router.proc.wait(timeout=60)
    (span,) = request_spans(traces)
    attributes = {a["key"]: a["value"] for a in span["attributes"]}
    assert attributes["url.path"] == {"stringValue": "/v1/chat/completions"}
