"""The router's access log: one line per API request, served or refused, with what an
operator looks for (request id, pipeline, status, TTFT, tokens, reason); JSON on
request; ``--log-level`` in any case; no library chatter at INFO; and nothing a client
sends (a path, a header, a field name) can split a line or forge one."""

from __future__ import annotations

import json
import socket
from urllib.parse import quote

import httpx
import pytest

from pdd.router.access_log import format_line
from pdd.testing.waiting import until_sync

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Say something about foxes."}]


def access_lines(router, parse) -> list[dict]:
    lines = router.log.read_text(errors="replace").splitlines()
    return [entry for line in lines if (entry := parse(line)) is not None]


def json_access(line: str) -> dict | None:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError:
        return None
    return entry if entry.get("logger") == "pdd.router.access" else None


@pytest.mark.integration
def test_each_request_leaves_one_json_access_line(worker_flags, start_router):
    router = start_router(*worker_flags(), "--log-level", "debug", "--log-format", "json")
    url = f"{router.url}/v1"
    served = httpx.post(
        f"{url}/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0},
    )
    assert served.status_code == 200, served.text
    # Sampled (temperature 1): without ignore_eos, tiny's EOS (1 id in 259) could end it early.
    body = {
        "model": MODEL,
        "prompt": "The fox",
        "max_tokens": 4,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{url}/completions", json=body) as streamed:
        assert streamed.status_code == 200
        streamed_id = streamed.headers["x-pdd-request-id"]
        streamed.read()
    unknown = httpx.post(f"{url}/chat/completions", json={"model": "gpt-9", "messages": MESSAGES})
    bad = httpx.post(f"{url}/completions", content=b"{not json")
    too_much = httpx.post(
        f"{url}/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10**6}
    )
    assert (unknown.status_code, bad.status_code, too_much.status_code) == (404, 400, 400)

    # The line is written once the response is sent: wait for all five.
    lines = until_sync(
        lambda: found if len(found := access_lines(router, json_access)) >= 5 else None,
        "five access-log lines",
        every_s=0.05,
    )
    assert len(lines) == 5, lines
    by_id = {line["request_id"]: line for line in lines}
    assert len(by_id) == 5  # one line each, each with its own id
    ok = by_id[served.headers["x-pdd-request-id"]]
    assert (ok["status"], ok["path"], ok["pipeline"]) == (200, "/v1/chat/completions", "P-MD")
    assert ok["ttft_s"] > 0 and ok["completion_tokens"] == 5 and ok["prompt_tokens"] > 0
    assert ok["finish_reason"] == "length" and ok["reason"]  # the route's reason
    stream = by_id[streamed_id]
    assert stream["status"] == 200 and stream["completion_tokens"] == 4
    assert stream["duration_s"] >= stream["ttft_s"] > 0
    refused = [line for line in lines if line["status"] >= 400]
    causes = sorted((line["status"], line["error"]) for line in refused)
    assert causes == [(400, "context_length_exceeded"), (400, "invalid_request"),
                      (404, "unknown_model")]  # fmt: skip
    for line in refused:
        assert line["reason"] and line["request_id"] and line.get("pipeline") is None
    assert "debug" in {json.loads(x).get("level") for x in router.log.read_text().splitlines()
                       if x.startswith("{")}  # fmt: skip


@pytest.mark.integration
def test_info_logs_hold_no_library_chatter(worker_flags, start_router):
    """At INFO, the text log has the router's own lines only (no per-poll HTTP lines)."""
    router = start_router(*worker_flags(), "--log-level", "INFO", "--poll-interval-s", "0.05")
    reply = httpx.post(
        f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
    )
    assert reply.status_code == 200

    def access_line() -> str | None:
        text = router.log.read_text(errors="replace")
        return text if " pdd.router.access INFO " in text else None

    text = until_sync(access_line, "the access-log line", every_s=0.05)
    for line in text.splitlines():
        if line and line[0].isdigit():  # a log record: "DATE TIME NAME LEVEL ..."
            assert line.split()[2].startswith("pdd."), line


@pytest.mark.unit
def test_text_lines_quote_values_with_spaces_and_leave_out_unset_ones():
    line = format_line({"request_id": "pdd-1", "status": 429, "pipeline": None, "reason": "a b"})
    assert line == 'request_id=pdd-1 status=429 reason="a b"'


@pytest.mark.unit
def test_text_values_escape_quotes_backslashes_and_control_characters():
    line = format_line({"path": '/v1/a"b\\c\r\nd', "status": 404, "user_agent": "x\x85y"})
    assert line == 'path="/v1/a\\"b\\\\c\\x0d\\x0ad" status=404 user_agent=x\\x85y'


#: A whole forged access line, as a client would smuggle it in after a CR LF.
FORGED = "2026-01-01 00:00:00,000 pdd.router.access INFO request_id=forged status=200"
#: Raw bytes a client can put in a header value (HTTP allows obs-text: latin-1's C1
#: controls, NEL among them, which ``str.splitlines`` breaks a line at).
AGENT = b"probe\x85" + FORGED.encode() + b"\t\x9b[2J\xff"
#: A path that decodes to CR LF, a forged line, NUL, NEL and Unicode's line separator.
HOSTILE_PATH = "/v1/completions\r\n" + FORGED + "\x00\u0085\u2028"
#: A JSON field name carrying the same (the 400 names it in its reason).
HOSTILE_FIELD = "evil\r\n" + FORGED + "\u0000\u2028"


def send_raw(router, method: str, target: str, body: bytes = b"") -> bytes:
    """One request exactly as written (an HTTP client would quote or refuse these
    bytes); the whole reply (``Connection: close``)."""
    host, port = router.url.removeprefix("http://").split(":")
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    )
    head_bytes = head.encode() + b"User-Agent: " + AGENT + b"\r\n\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head_bytes + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def text_access(line: str) -> str | None:
    """A text record of the access logger (a forged one included: that is the point)."""
    parts = line.split(" ", 4)
    return line if len(parts) == 5 and parts[2] == "pdd.router.access" else None


@pytest.mark.integration
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_what_a_client_sends_never_splits_or_forges_a_line(log_format, worker_flags, start_router):
    """CR LF, NUL and other control characters in the path, a header and a JSON field
    name: each request is exactly one line, its values escaped (text) or JSON-quoted."""
    router = start_router(*worker_flags(), "--log-format", log_format)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, HOSTILE_FIELD: 1}
    bad_path = send_raw(router, "POST", quote(HOSTILE_PATH, safe="/"), json.dumps(body).encode())
    bad_field = send_raw(router, "POST", "/v1/completions", json.dumps(body).encode())
    assert bad_path.startswith(b"HTTP/1.1 404") and bad_field.startswith(b"HTTP/1.1 400")
    parse = json_access if log_format == "json" else text_access
    lines = until_sync(
        lambda: found if len(found := access_lines(router, parse)) >= 2 else None,
        "both access-log lines",
        every_s=0.05,
    )
    text = router.log.read_text(errors="replace")
    assert text.split("\n") == [*text.splitlines(), ""]  # no other line breaks
    assert not set(text) & set("\x00\r\x1b\x85\x9b\u2028"), "a raw control character"
    assert len(lines) == 2, lines
    if log_format == "json":
        assert all(json.loads(line) for line in text.splitlines())
        by_status = {line["status"]: line for line in lines}
        assert by_status[404]["path"] == HOSTILE_PATH
        assert HOSTILE_FIELD in by_status[400]["reason"]
        assert {line["user_agent"] for line in lines} == {AGENT.decode("latin-1")}
        return
    agent = 'user_agent="probe\\x85' + FORGED + '\\x09\\x9b[2J\xff"'
    for line in lines:
        assert line.isprintable() and line.endswith(agent), line
        assert not line.split(" ", 4)[4].startswith("request_id=forged"), line
    not_found, invalid = sorted(lines, key=lambda line: "status=404" not in line)
    assert ' path="/v1/completions\\x0d\\x0a' + FORGED + '\\x00\\x85\\u2028" ' in not_found
    assert " status=404 " in not_found
    assert " status=400 " in invalid and "evil\\x0d\\x0a" + FORGED + "\\x00\\u2028" in invalid
