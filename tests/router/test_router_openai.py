"""The official openai client against ``pdd router`` with real P/RLD/MD workers behind it."""

import httpx
import openai
import pytest

from pdd.common.config_document import API_KEYS_ENV
from pdd.common.wire import WorkerHealth
from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration

MODEL = "tiny"
KEY = "sk-test-1"
MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}]


@pytest.fixture(scope="module")
def router(worker_flags, start_router):
    """Keys from a flag and, as a pod gets them from a Secret, from the environment."""
    env = {API_KEYS_ENV: "sk-test-2,\nsk-test-3"}
    return start_router(*worker_flags(), "--api-key", KEY, env=env)


@pytest.fixture(scope="module")
def slow_link_router(worker_flags, start_router):
    """Declares a WAN so slow that no transfer fits the budget: every request relays. It
    also caps prompts below what prefill takes."""
    return start_router(
        *worker_flags(), "--link-gbps", "0.0001", "--ttft-budget-s", "0.05",
        "--max-prompt-tokens", "64",
    )  # fmt: skip


def client(router, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0)


def chat(router, stream: bool, **kwargs):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0.0}
    return client(router).chat.completions.with_raw_response.create(
        **{**args, **kwargs}, stream=stream
    )


def test_chat_streaming_equals_non_streaming(router):
    raw = chat(router, stream=False)
    whole = raw.parse()
    assert raw.headers["x-pdd-pipeline"] == "P-MD"
    assert "budget" in raw.headers["x-pdd-reason"]
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
    assert whole.choices[0].finish_reason in ("stop", "length")
    raw_stream = chat(router, stream=True, stream_options={"include_usage": True})
    chunks = list(raw_stream.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens
    )


def test_relayed_pipeline_gives_the_same_tokens(router, slow_link_router):
    """P-RLD-MD (tokens from the relay, then MD after the handoff) must be token-exact
    with P-MD: the same greedy text, gapless and without duplicates."""
    args = {"model": MODEL, "prompt": "The lazy dog sleeps while", "max_tokens": 40}
    direct = client(router).completions.create(
        **args, temperature=0.0, extra_body={"ignore_eos": True}
    )
    raw = openai.OpenAI(base_url=f"{slow_link_router.url}/v1", api_key="x", max_retries=0)
    relayed = raw.completions.with_raw_response.create(
        **args, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    assert relayed.headers["x-pdd-pipeline"] == "P-RLD-MD"
    hops = dict(hop.split("=", 1) for hop in relayed.headers["x-pdd-route"].split())
    assert hops["prefill"].split(":")[0] == "p" and hops["relay"] == "rld"  # the relay has no hit
    assert hops["main"].split(":")[0] in ("md1", "md2")
    text = "".join(c.choices[0].text for c in relayed.parse() if c.choices)
    assert text == direct.choices[0].text
    assert direct.usage.completion_tokens == 40
    # this router's own cap, below prefill's limit, wins
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        raw.completions.create(model=MODEL, prompt="fox " * 100, max_tokens=1)


def test_forced_naive_baseline_ships_full_kv_with_the_same_tokens(
    router, worker_flags, start_router
):
    """``--force-pipeline naive`` (the benchmark baseline) routes P -> MD with no DRC."""
    naive = start_router(*worker_flags(), "--force-pipeline", "naive")
    args = {"model": MODEL, "prompt": "Naive cross-datacenter PD is", "max_tokens": 16}
    expected = client(router).completions.create(**args, temperature=0.0)
    for _ in range(2):  # a repeat, whose prefix MD could hold, still goes naive
        raw = openai.OpenAI(base_url=f"{naive.url}/v1", api_key="x", max_retries=0)
        got = raw.completions.with_raw_response.create(**args, temperature=0.0)
        assert got.headers["x-pdd-pipeline"] == "naive"
        assert "forced baseline" in got.headers["x-pdd-reason"]
        assert got.parse().choices[0].text == expected.choices[0].text


def test_completion_usage_reports_the_real_prefix_hit_on_a_repeat(router):
    prompt = "A prompt long enough to fill several sixteen-token blocks of the prefix cache. " * 2
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    first = client(router).completions.create(**args)
    n = first.usage.prompt_tokens
    assert n == len(prompt.encode())
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # P never saw it
    again = client(router).completions.create(**args)  # no wait for the index: P measures it
    # P's cache holds every full block of the prompt but the one with its last token.
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert again.choices[0].text == first.choices[0].text


def test_models_and_probes(router):
    assert [m.id for m in client(router).models.list().data] == [MODEL]
    for probe in ("/startup", "/live", "/ready"):  # the operator's probes, one path each
        assert httpx.get(f"{router.url}{probe}").status_code == 200
    chat(router, stream=False)  # this test's own request: the metrics must count it
    metrics = httpx.get(f"{router.url}/metrics").text
    assert 'pdd_router_requests_total{pipeline="P-MD",reason="fits_ttft_budget"}' in metrics
    assert "pdd_router_ttft_seconds_bucket" in metrics


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["message"]
    return body["error"]


def test_bad_requests_get_openai_errors_and_the_router_keeps_serving(router, cluster):
    url, auth = f"{router.url}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    bad_json = httpx.post(url, content=b'{"model": "tiny", "messages": [', headers=auth)
    assert bad_json.status_code == 400 and _error(bad_json)["type"] == "invalid_request_error"
    missing = httpx.post(url, json={"model": MODEL}, headers=auth)
    assert missing.status_code == 400 and _error(missing)["param"] == "messages"
    unknown = httpx.post(url, json={"model": "gpt-9", "messages": MESSAGES}, headers=auth)
    assert unknown.status_code == 404 and _error(unknown)["param"] == "model"
    # The limit is what prefill reports taking (its engine's), not a number of the router's.
    limit = WorkerHealth.model_validate(
        httpx.get(f"{cluster['p'].url}/health").json()
    ).engine.max_prompt_tokens
    long_prompt = [{"role": "user", "content": "x " * limit}]
    too_long = httpx.post(url, json={"model": MODEL, "messages": long_prompt}, headers=auth)
    assert too_long.status_code == 400
    assert f"at most {limit}" in _error(too_long)["message"]
    huge = httpx.post(url, content=b"{" + b" " * (5 << 20) + b"}", headers=auth)
    assert huge.status_code == 413 and _error(huge)
    with pytest.raises(openai.AuthenticationError):
        client(router, key="sk-wrong").chat.completions.create(model=MODEL, messages=MESSAGES)
    no_key = httpx.post(url, json={"model": MODEL, "messages": MESSAGES})
    assert no_key.status_code == 401 and _error(no_key)["type"] == "authentication_error"
    for key in ("sk-test-2", "sk-test-3"):
        ok = client(router, key=key).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2
        )
        assert ok.usage.completion_tokens >= 1
    metrics = httpx.get(f"{router.url}/metrics").text
    for cause in ("invalid_request", "unknown_model", "prompt_too_long", "unauthorized"):
        assert f'pdd_router_rejected_requests_total{{cause="{cause}"}}' in metrics


def test_saturated_router_answers_429_with_retry_after(worker_flags, start_router, cluster):
    """One MD that takes one request at a time (its load report says so): a second request
    is refused, not queued."""
    small = start_router(*worker_flags(mains=("md_one",)))
    body = {"model": MODEL, "prompt": "hold the line", "max_tokens": 3000, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{small.url}/v1/completions", json=body, timeout=60) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # keep it: dropping it closes the stream
        next(lines)  # the first token arrived: md_one is busy with this request
        refused = httpx.post(f"{small.url}/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert _error(refused)["type"] == "rate_limit_error"
    # Closing the stream cancelled the request on the workers: md_one takes work again (once
    # the router's next poll of md_one's load has seen it).
    cluster.wait_quiescent()
    again = {**body, "stream": False, "max_tokens": 2}

    def served() -> httpx.Response | None:
        reply = httpx.post(f"{small.url}/v1/completions", json=again)
        return None if reply.status_code == 429 else reply

    ok = until_sync(served, "md_one taking work again after the request ended", every_s=0.1)
    assert ok.status_code == 200, ok.text


def test_client_disconnect_cancels_the_request_on_the_workers(router, cluster):
    body = {"model": MODEL, "prompt": "never finish", "max_tokens": 3500, "stream": True}
    body["ignore_eos"] = True
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=auth) as resp:
        request_id = resp.headers["x-pdd-request-id"]
        main = resp.headers["x-pdd-route"].split("main=")[1].split(":")[0]
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
    # The worker's own stream replays the request's tokens and ends when it does; a
    # cancelled request ends long before its 3500 tokens.
    url = f"{cluster[main].url}/v1/pdd/requests/{request_id}/stream"
    events = httpx.get(url, headers={"Authorization": f"Bearer {cluster.secret}"}, timeout=120)
    tokens = [line for line in events.text.splitlines() if '"token_id":null' not in line]
    assert 0 < len(tokens) < 3500
    states = cluster.wait_quiescent()
    assert all(s.quiescent for s in states.values()), states


def test_prompt_plus_max_tokens_beyond_the_context_is_a_400_naming_both(router, cluster):
    """As vLLM answers it: a request that cannot finish within the model's context window
    is refused up front (not served 200 with a truncated ``length`` answer), the message
    naming the window, the prompt's tokens and max_tokens; a request without max_tokens
    gets a default that fits what the prompt leaves."""
    engine = WorkerHealth.model_validate(httpx.get(f"{cluster['p'].url}/health").json()).engine
    context = engine.max_model_len
    tokens = context - 300
    prompt = [7] * tokens  # token IDs: the prompt's length is exact
    over = context - tokens + 1
    with pytest.raises(openai.BadRequestError) as refused:
        client(router).completions.create(model=MODEL, prompt=prompt, max_tokens=over)
    message = refused.value.body["message"]
    assert refused.value.status_code == 400 and refused.value.body["param"] == "max_tokens"
    for number in (context, tokens, over):
        assert str(number) in message
    with pytest.raises(openai.BadRequestError):
        client(router).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1_000_000)
    # Exactly filling the window is allowed; without max_tokens the default shrinks to fit.
    fits = client(router).completions.create(
        model=MODEL, prompt=prompt, max_tokens=over - 1, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert fits.usage.completion_tokens == over - 1
    left = client(router).completions.create(
        model=MODEL, prompt=prompt, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert left.usage.completion_tokens == min(over - 1, 256)
