"""A client that goes away mid-request: the work done for it stops on every worker, and
the router's access log still has exactly one line for it.

Three ways to leave: a stream closed after its first chunk (the line keeps the 200 that
went out, with ``error=client_disconnected``); a non-streaming request closed while the
workers generate its answer (no status went out: the line says 499, as nginx logs a
client that went away, and the generation is aborted, as vLLM aborts it, rather than
run to its end for nobody); a request body cut halfway (499 too, and no traceback).
Each test finds its line by its own user agent.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration

#: Seconds of decoding even on a fast machine (docs/testing.md): a cancel ends it long before.
MAX_TOKENS = 3500


@pytest.fixture(scope="module")
def router(worker_flags, start_router):
    """One MD (so the test knows where a generation runs), JSON lines (to read the log)."""
    return start_router(*worker_flags(mains=("md1",)), "--log-format", "json")


def access_lines(router, agent: str) -> list[dict]:
    """The access-log lines of the requests sent with user agent ``agent``."""
    found = []
    for line in router.log.read_text(errors="replace").splitlines():
        entry = json.loads(line) if line.startswith("{") else {}
        if entry.get("logger") == "pdd.router.access" and entry.get("user_agent") == agent:
            found.append(entry)
    return found


def completion(stream: bool) -> dict:
    return {
        "model": "tiny", "prompt": "tell me everything you know", "max_tokens": MAX_TOKENS,
        "ignore_eos": True, "stream": stream,
    }  # fmt: skip


def open_request(router, agent: str, body: bytes, sent: int | None = None) -> socket.socket:
    """A POST to /v1/completions whose first ``sent`` body bytes (all by default) are sent;
    nothing of the response is read."""
    host, port = router.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nUser-Agent: {agent}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body[:sent])
    return sock


def assert_workers_hold_nothing(cluster) -> None:
    states = cluster.wait_quiescent()
    assert all(s.quiescent for s in states.values()), states


def test_a_stream_left_after_its_first_chunk_leaves_one_line(router, cluster):
    agent = "leaves-after-one-chunk"
    url = f"{router.url}/v1/completions"
    headers = {"user-agent": agent}
    with httpx.stream("POST", url, json=completion(True), headers=headers, timeout=None) as resp:
        assert resp.status_code == 200
        request_id = resp.headers["x-pdd-request-id"]
        next(line for line in resp.iter_lines() if line.startswith("data: {"))
    (line,) = until_sync(lambda: access_lines(router, agent), "the stream's access line")
    assert (line["request_id"], line["status"]) == (request_id, 200)
    assert line["error"] == "client_disconnected" and line["finish_reason"] is None
    assert 0 < line["completion_tokens"] < MAX_TOKENS and line["ttft_s"] > 0
    assert_workers_hold_nothing(cluster)
    assert len(access_lines(router, agent)) == 1


def test_a_non_streaming_request_left_mid_generation_is_aborted_and_logged_499(router, cluster):
    """The client closes its connection while md1 decodes its 3,500 tokens: the router
    notices at once (not when the answer is ready), cancels the request on the workers,
    which free its blocks and leases, and logs 499."""
    agent = "gives-up-waiting"
    md = cluster["md1"]
    sock = open_request(router, agent, json.dumps(completion(False)).encode())
    try:
        until_sync(lambda: md.state(cluster.secret).engine_requests > 0, "md1 decoding it")
    finally:
        sock.close()
    (line,) = until_sync(lambda: access_lines(router, agent), "the request's access line")
    assert line["status"] == 499 and line["error"] == "client_disconnected", line
    assert line["pipeline"] == "P-MD" and line["completion_tokens"] < MAX_TOKENS
    # md1's own record of the request's tokens (kept a while after it ended) stops
    # short: the generation was aborted, not run to its end.
    events = httpx.get(
        f"{md.url}/v1/pdd/requests/{line['request_id']}/stream",
        headers={"Authorization": f"Bearer {cluster.secret}"},
        timeout=None,
    )
    tokens = [x for x in events.text.splitlines() if '"token_id":null' not in x]
    assert len(tokens) < MAX_TOKENS
    assert_workers_hold_nothing(cluster)
    assert len(access_lines(router, agent)) == 1


def test_a_body_cut_halfway_is_a_499_line_without_a_traceback(router):
    agent = "cut-short"
    body = json.dumps(completion(False)).encode()
    open_request(router, agent, body, sent=len(body) // 2).close()
    (line,) = until_sync(lambda: access_lines(router, agent), "the request's access line")
    assert line["status"] == 499 and line["error"] == "client_disconnected", line
    log = router.log.read_text(errors="replace")
    assert "Traceback" not in log and '"level": "error"' not in log
