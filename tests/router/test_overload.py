"""Past its capacity the router queues a request within a bounded wait, then sheds it
with 429 and Retry-After. (The order in which the keys' queued requests get slots is
pinned down in ``test_fair_admission``, on a virtual clock; ``bench/overload.py``
measures it with two keys at 2x and 4x the stack's capacity.)

Like the saturation test in ``test_router_openai``, this needs a request still running
while it makes one more call: it asks for thousands of tokens, seconds of decoding,
against the milliseconds the call takes."""

import re

import httpx
import pytest

from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration

NOISY, QUIET = "sk-noisy", "sk-quiet"
HOLD = {"model": "tiny", "prompt": "hold the line", "max_tokens": 3500, "ignore_eos": True}
SHORT = {"model": "tiny", "prompt": "a short one", "max_tokens": 2}


def _router(start_router, worker_flags, wait_s: str):
    keys = ["--api-key", NOISY, "--api-key", QUIET]
    return start_router(
        *worker_flags(), *keys, "--max-inflight-requests", "1", "--admission-wait-s", wait_s
    )


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _gauge(router, name: str) -> float:
    text = httpx.get(f"{router.url}/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_past_capacity_a_request_waits_its_bound_then_gets_429(worker_flags, start_router):
    router = _router(start_router, worker_flags, "0.2")
    url = f"{router.url}/v1/completions"
    body = {**HOLD, "stream": True}
    with httpx.stream("POST", url, json=body, headers=_auth(NOISY), timeout=60) as held:
        lines = held.iter_lines()
        next(lines)  # the first token came: the router's one slot is taken
        refused = httpx.post(url, json=SHORT, headers=_auth(QUIET), timeout=60)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
    # The stream's end gave its slot back: the next request is admitted.
    until_sync(lambda: _gauge(router, "pdd_router_admitted_requests") == 0, "slot given back")
    ok = httpx.post(url, json=SHORT, headers=_auth(QUIET), timeout=60)
    assert ok.status_code == 200, ok.text
    metrics = httpx.get(f"{router.url}/metrics").text
    assert 'pdd_router_rejected_requests_total{cause="overloaded"}' in metrics
