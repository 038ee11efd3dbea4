"""The router's OpenAI API under schema-driven fuzzing: never a 5xx, nothing left behind.

Schemathesis reads the router's own OpenAPI document (which names each route's request
model) and generates requests that fit it and requests that break it, against a real
``pdd router`` in front of real P, RLD and MD workers. Every answer must be below 500
(a bad request is the client's 4xx with a reason; a good one is served), and afterwards
the router is still ready and every worker holds no request state, lock or block.
``--max-tokens-limit`` keeps each served request short, and is itself under test: a
larger ``max_tokens`` must be a 400.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow

#: Cases per (POST operation, mode): 2 operations x 2 modes make 2,200 requests (the GET
#: routes take no input, so their few cases come on top).
POST_CASES = 550
GET_CASES = 20
MAX_TOKENS_LIMIT = 8
#: 2,200 requests take about 4 minutes on an idle 2-core machine and three times that on
#: a busy one: beyond the suite's per-test 300 s, well within CI's limit.
FUZZ_TIMEOUT_S = 1800
#: The router ends a request after its own ``--request-timeout-s``; the client waits
#: longer, so an overloaded machine gets the router's answer, not a client-side timeout
#: (one run with two suites and an out-of-memory kill beside it read a 60 s one).
ROUTER_REQUEST_TIMEOUT_S = 60
CLIENT_TIMEOUT_S = 5 * ROUTER_REQUEST_TIMEOUT_S


@pytest.fixture(scope="module")
def router(start_router, worker_flags):
    return start_router(
        *worker_flags(), "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
        "--request-timeout-s", str(ROUTER_REQUEST_TIMEOUT_S),
    )  # fmt: skip


def served_model(case):
    """Schema-valid bodies name the served model, so they reach the workers instead of
    all stopping at the 404 for an unknown model."""
    if isinstance(case.body, dict):
        case.body["model"] = "tiny"
    return case


def fuzz(url: str, operation, mode: GenerationMode, cases: int, seen: Counter) -> None:
    strategy = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:
        strategy = strategy.map(served_model)

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases on every run: a failure reproduces
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def one(case) -> None:
        response = case.call(base_url=url, timeout=CLIENT_TIMEOUT_S)
        seen[response.status_code] += 1
        assert response.status_code < 500, (
            f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
            f"body: {case.body!r}"[:2000]
        )

    one()


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_no_request_the_schema_allows_or_breaks_gets_a_5xx(router, cluster) -> None:
    schema = schemathesis.openapi.from_url(f"{router.url}/openapi.json")
    seen: Counter = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    posts = [op for op in operations if op.method.lower() == "post"]
    assert {op.path for op in posts} == {"/v1/chat/completions", "/v1/completions"}
    for op in posts:
        assert op.body, f"{op.path} has no documented request body to fuzz"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(router.url, op, mode, POST_CASES, seen)
    for op in operations:
        if op.method.lower() == "get":
            fuzz(router.url, op, GenerationMode.POSITIVE, GET_CASES, seen)
    assert sum(seen.values()) >= 2000, seen
    assert seen[200] >= 100 and seen[400] >= 100, seen  # served and refused requests ran
    assert httpx.get(f"{router.url}/ready", timeout=10).status_code == 200
    states = cluster.wait_quiescent()
    assert all(s.quiescent for s in states.values()), states


def test_max_tokens_beyond_the_limit_is_a_400_with_the_limit(router) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": MAX_TOKENS_LIMIT + 1}
    answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "max_tokens" and f"({MAX_TOKENS_LIMIT})" in error["message"]
