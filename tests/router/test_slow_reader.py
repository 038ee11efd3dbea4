"""A client that stops reading its stream holds a bounded buffer in the router and slows
nobody else.

The slow client asks for two long answers (``n=2``) with the top-20 logprobs on every
token (about 1 KB a frame, some 8 MB in all: more than the sockets between it and the
router hold, at most the kernel's 4 MiB send buffer and a small receive buffer), reads
the response headers and then nothing. The workers finish generating regardless; the
router must stop reading the request's worker streams once its per-request buffer
(``STREAM_BUFFER_EVENTS``) is full, rather than pull the whole answer into memory, and
other clients, meanwhile, get the same answers, complete, as before the slow one came.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from pdd.router.stream_relay import STREAM_BUFFER_EVENTS
from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration

FAST_CLIENTS = 6
FAST_TOKENS = 32
SLOW_TOKENS = 4000


@pytest.fixture(scope="module")
def router(worker_flags, start_router):
    return start_router(*worker_flags())


def _buffered(router) -> float:
    """The fullest stream buffer in the router; never above the bound."""
    text = httpx.get(f"{router.url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("pdd_router_stream_buffered_events "))
    events = float(line.split()[1])
    assert events <= STREAM_BUFFER_EVENTS, f"{events} events buffered for one stream"
    return events


def _fast_answers(router) -> list[str]:
    """FAST_CLIENTS streamed completions, read to the end: their texts."""
    texts = []
    for i in range(FAST_CLIENTS):
        body = {
            "model": "tiny", "prompt": f"fast client {i}: the quick brown fox", "stream": True,
            "max_tokens": FAST_TOKENS, "ignore_eos": True, "temperature": 0.0,
        }  # fmt: skip
        text, frames = "", 0
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
                    frames += 1
        assert frames >= 1
        texts.append(text)
    return texts


def _slow_client(router) -> socket.socket:
    """Sends a long streamed chat request and reads only the status line and headers."""
    host, port = router.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.connect((host, int(port)))
    body = json.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": "tell me everything"}],
        "stream": True, "max_tokens": SLOW_TOKENS, "ignore_eos": True, "temperature": 0.0,
        "logprobs": True, "top_logprobs": 20, "n": 2,
    }).encode()  # fmt: skip
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(1)  # byte by byte: nothing of the body is read
    assert got.startswith(b"HTTP/1.1 200"), got
    return sock


def test_a_slow_reader_holds_a_bounded_buffer_and_slows_no_one(router, cluster):
    baseline = _fast_answers(router)
    slow = _slow_client(router)
    try:
        # The workers generate the whole answer whatever the client reads...
        states = cluster.wait_quiescent(timeout_s=180)
        assert all(s.quiescent for s in states.values()), states
        _buffered(router)
        # ...and the router, whose sockets to the client are full, holds its bound of them.
        until_sync(
            lambda: _buffered(router) == STREAM_BUFFER_EVENTS,
            f"the slow stream's buffer in the router full ({STREAM_BUFFER_EVENTS} events)",
        )
        # Others are served, whole and unchanged, while the slow client reads nothing.
        assert _fast_answers(router) == baseline
        assert _buffered(router) <= STREAM_BUFFER_EVENTS
    finally:
        slow.close()
    states = cluster.wait_quiescent()
    assert all(s.quiescent for s in states.values()), states
    until_sync(lambda: _buffered(router) == 0, "no stream buffered once the slow client left")
