"""The router's access log: one line per API request, served or refused, with what an
operator looks for (request id, pipeline, status, TTFT, tokens, reason); JSON on
request; ``--log-level`` in any case; no library chatter at INFO."""

from __future__ import annotations

import json

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
