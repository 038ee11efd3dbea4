"""Hostile requests beside innocent ones, against a real router in front of real P, RLD and
MD workers: one user's bad request never harms another.

Hypothesis builds hostile requests two ways: over the OpenAI request models themselves
(every field of ``ChatCompletionRequest`` and ``CompletionRequest``, so a field added
later is fuzzed too, set to values of the wrong type, out of range, deeply nested, with
lone surrogates and control characters, structured-output schemas that recurse or nest
deep, content parts of every kind), and as raw bytes (a valid body cut, spliced, flipped
or wrapped in deep nesting, or sent as another content type). While they run, a thread
keeps sending a fixed set of innocent requests (greedy, so their answers are known from
a clean run first). The verdicts: no hostile request gets a 5xx, every error is the
OpenAI error shape, every innocent request is a 200 with the same text as its clean run,
no log line is a traceback and every router log line parses as JSON (nothing a client
sends forges a line), every ``/v1`` request has exactly one access-log line, and
afterwards no worker holds a request, lock or block and the router has nothing admitted.

The default suite runs one round of ``FAST_EXAMPLES`` hostile requests; the slow tier
runs rounds for ``PDD_HOSTILE_FUZZ_S`` seconds (default ``LONG_DEFAULT_S``;
docs/reliability.md has a 30-minute run). Each run's seed is printed, and
``PDD_HOSTILE_FUZZ_SEED`` replays it.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from pdd.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdd.testing.waiting import until_sync

MAX_TOKENS_LIMIT = 16
FAST_EXAMPLES = 120
LONG_DEFAULT_S = 240.0
LONG_ROUND_EXAMPLES = 100
ROUTER_REQUEST_TIMEOUT_S = 60
CLIENT_TIMEOUT_S = 5 * ROUTER_REQUEST_TIMEOUT_S

#: The schema that once failed every request in the batch it joined.
RECURSIVE_SCHEMA = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}

INNOCENT: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello, how are you?"}]}),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "The quick brown fox jumps over the lazy dog. Why?"},
            ]
        },
    ),
    ("/v1/completions", {"prompt": "weather in Paris is sunny"}),
    ("/v1/completions", {"prompt": "system user assistant tool", "stream": True}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Give a city as JSON"}],
            "response_format": {"type": "json_object"},
        },
    ),
]


def innocent_body(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": "tiny", "temperature": 0, "max_tokens": MAX_TOKENS_LIMIT, **body}


# --- hostile values -------------------------------------------------------------------------

_weird_text = st.lists(
    st.one_of(
        st.characters(codec=None),  # lone surrogates included
        st.sampled_from(["\x00", "\r\n", "\x1b[2J", "\u2028", "\ud800", "\udfff", "%0d%0a"]),
    ),
    max_size=20,
).map("".join)
_numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 1e308, -1e308, 1e-300, True, False]),
)


def _deep(depth: int, leaf: Any = 0) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


def _nest_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


_deep_values = st.integers(min_value=20, max_value=900).map(_deep)  # json.dumps can write it
_json_leaf = st.one_of(st.none(), st.booleans(), _numbers, _weird_text)
_json_any = st.recursive(
    _json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(_weird_text, inner, max_size=4)
    ),
    max_leaves=12,
)
_content_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": _weird_text}),
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["image_url", "input_audio", "file"]),
                "image_url": st.just({"url": "data:image/png;base64,AAAA"}),
            }
        ),
        st.dictionaries(_weird_text, _json_any, max_size=3),
    ),
    max_size=4,
)
_schema_keys = st.sampled_from(
    ["type", "properties", "items", "$ref", "enum", "pattern", "required", "minItems",
     "maxLength", "anyOf", "$defs"]
)  # fmt: skip
_schemas = st.one_of(
    st.just(RECURSIVE_SCHEMA),
    st.integers(min_value=50, max_value=400).map(_nest_schema),
    st.lists(_weird_text, min_size=1, max_size=4).map(lambda e: {"enum": e}),
    st.dictionaries(_schema_keys, _json_any, max_size=4),
    st.just({"type": "string", "pattern": "(a+)+$" * 50}),
    st.just({"type": "array", "minItems": 10**9, "items": {"type": "integer"}}),
)
_response_formats = st.one_of(
    _json_any,
    _schemas.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
)
_tools = st.lists(
    _schemas.map(lambda s: {"type": "function", "function": {"name": "f", "parameters": s}}),
    min_size=1,
    max_size=2,
)
_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.one_of(st.sampled_from(["system", "user", "assistant"]), _weird_text),
            "content": st.one_of(_weird_text, _content_parts, _json_any),
        }
    ),
    max_size=3,
)

#: Field-specific hostile values, beside the generic ones every field gets.
_FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "messages": _messages,
    "response_format": _response_formats,
    "tools": _tools,
    "prompt": st.one_of(_weird_text, st.lists(_numbers, max_size=8)),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["messages", "tools", "add_generation_prompt", "bos_token", "x"]),
        _json_any,
        max_size=3,
    ),
    "stop": st.one_of(_weird_text, st.lists(_weird_text, max_size=4)),
    "logit_bias": st.dictionaries(_weird_text, _numbers, max_size=4),
}
#: Values a client may well send: odd but valid, so such requests reach the engines and
#: are served in the same batches as the innocent ones (grammars, penalties, logprobs).
_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, MAX_TOKENS_LIMIT),
    "temperature": st.sampled_from([0, 0.5, 1.0, 2.0]),
    "top_p": st.sampled_from([0.1, 0.9, 1.0]),
    "top_k": st.sampled_from([-1, 1, 5]),
    "seed": st.integers(0, 2**31),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "min_tokens": st.integers(0, MAX_TOKENS_LIMIT),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.sampled_from([-2.0, 0.5, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.5, 2.0]),
    "repetition_penalty": st.sampled_from([0.5, 1.3, 2.0]),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.sampled_from([-100, 100])),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "prompt": st.text(max_size=200).filter(lambda t: not _has_surrogate(t)),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant"]),
                "content": st.one_of(
                    st.text(max_size=100).filter(lambda t: not _has_surrogate(t)),
                    st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                    "text": st.sampled_from(["hi", "é\x00"])})),
                ),
            }
        ),
        min_size=1, max_size=3,
    ),
    "response_format": st.sampled_from([
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
        {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": ["x", "y"]}}},
    ]),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]),
}  # fmt: skip


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in text)


_CONTENT_TYPES = ["text/plain", "", "application/x-www-form-urlencoded"]
_PATH_TAILS = ["%0d%0aforged: line", "%00", "/%2e%2e/x", "?a=%0a%00"]
_ENDPOINTS = [
    ("/v1/chat/completions", ChatCompletionRequest),
    ("/v1/completions", CompletionRequest),
]


def _hostile_value(name: str) -> st.SearchStrategy[Any]:
    generic = st.one_of(_json_leaf, _json_any, _deep_values)
    special = _FIELD_VALUES.get(name)
    return generic if special is None else st.one_of(special, generic)


def _field_names(model: type) -> list[str]:
    return sorted(f.alias or name for name, f in model.model_fields.items())


@st.composite
def hostile_request(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str], bool]:
    """A request: path, body bytes, headers, and whether the client leaves a stream
    after its first chunk."""
    path, model = draw(st.sampled_from(_ENDPOINTS))
    base = innocent_body(INNOCENT[0][1] if "chat" in path else INNOCENT[2][1])
    names = sorted(set(_field_names(model)) & set(_PLAUSIBLE))
    for name in draw(st.lists(st.sampled_from(names), max_size=4)):
        base[name] = draw(_PLAUSIBLE[name])
    if draw(st.booleans()):  # half the requests stay valid, or nearly: they are served
        leaves = base.get("stream") is True and draw(st.booleans())
        return path, json.dumps(base).encode(), {"content-type": "application/json"}, leaves
    for name in draw(st.lists(st.sampled_from(_field_names(model)), min_size=1, max_size=4)):
        base[name] = draw(_hostile_value(name))
    if draw(st.booleans()):
        base[draw(_weird_text)] = draw(_json_any)  # an unknown key
    body = json.dumps(base, allow_nan=True).encode()  # NaN/Infinity are hostile too
    kind = draw(st.sampled_from(["as-is", "as-is", "cut", "splice", "flip", "deep", "type"]))
    headers = {"content-type": "application/json"}
    if kind == "cut":
        body = body[: draw(st.integers(min_value=0, max_value=len(body)))]
    elif kind == "splice":
        at = draw(st.integers(min_value=0, max_value=len(body)))
        body = body[:at] + draw(st.binary(max_size=16)) + body[at:]
    elif kind == "flip":
        at = draw(st.integers(min_value=0, max_value=len(body) - 1))
        body = body[:at] + bytes([body[at] ^ draw(st.integers(1, 255))]) + body[at + 1 :]
    elif kind == "deep":
        depth = draw(st.integers(min_value=1000, max_value=100_000))
        body = b"[" * depth + body + b"]" * depth
    elif kind == "type":
        headers["content-type"] = draw(st.sampled_from(_CONTENT_TYPES))
    if draw(st.integers(0, 9)) == 0:
        path += draw(st.sampled_from(_PATH_TAILS))
    return path, body, headers, False


# --- the innocent side --------------------------------------------------------------------


def answer_text(path: str, response: httpx.Response, stream: bool) -> str:
    """What a client reads: the whole text of choice 0 and its finish reason."""
    if not stream:
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if "chat" in path else choice["text"]
        return f"{text}|{choice['finish_reason']}"
    parts, finish = [], None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        for choice in event["choices"]:
            delta = choice.get("delta", {}).get("content") if "chat" in path else choice["text"]
            parts.append(delta or "")
            finish = choice.get("finish_reason") or finish
    return f"{''.join(parts)}|{finish}"


def send_innocent(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> str:
    full = innocent_body(body)
    response = client.post(url + path, json=full, timeout=CLIENT_TIMEOUT_S)
    status = response.status_code
    assert status == 200, f"innocent {path} {full}: {status} {response.text[:300]}"
    return answer_text(path, response, bool(full.get("stream")))


@dataclass
class InnocentLoop:
    """Sends the innocent requests round and round until stopped; records every answer."""

    url: str
    expected: list[str]
    sent: int = 0
    wrong: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client() as client:
            while not self.stop.is_set():
                for (path, body), want in zip(INNOCENT, self.expected, strict=True):
                    try:
                        got = send_innocent(client, self.url, path, body)
                    except (AssertionError, httpx.HTTPError, ValueError) as e:
                        got = f"failed: {e!r}"
                    self.sent += 1
                    if got != want:
                        self.wrong.append(f"{path} {body}: got {got!r}, clean run {want!r}")


# --- the run --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def router(start_router, worker_flags):
    return start_router(
        *worker_flags(), "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
        "--request-timeout-s", str(ROUTER_REQUEST_TIMEOUT_S), "--log-format", "json",
    )  # fmt: skip


def _new_lines(offsets: dict[Path, int]) -> dict[Path, list[str]]:
    """Each log's lines written since ``offsets`` (path -> size then)."""
    out = {}
    for path, start in offsets.items():
        with path.open("rb") as f:
            f.seek(start)
            out[path] = f.read().decode("utf-8", errors="replace").splitlines()
    return out


def _access_lines(lines: list[str]) -> int:
    return sum('"pdd.router.access"' in ln for ln in lines)


def _router_idle(url: str) -> bool:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    gauges = ("pdd_router_admitted_requests ", "pdd_router_queued_requests ")
    samples = [ln for ln in text.splitlines() if ln.startswith(gauges)]
    return len(samples) == 2 and all(float(s.split()[-1]) == 0 for s in samples)


def run_hostile(router, cluster, examples: int, seconds: float | None) -> Counter:
    """Innocent requests looping in a thread while Hypothesis sends hostile ones, in
    rounds of ``examples`` until ``seconds`` passed (one round without); every verdict
    in the module docstring is checked here. Returns the hostile statuses seen."""
    run_seed = int(os.environ.get("PDD_HOSTILE_FUZZ_SEED", random.randrange(2**32)))
    print(f"hostile-input fuzz seed: {run_seed} (replay: PDD_HOSTILE_FUZZ_SEED={run_seed})")
    logs = [router.log, *(w.log for w in cluster.workers.values())]
    offsets = {p: p.stat().st_size for p in logs}  # before the clean run: a line is
    # written once the last byte went out, which may be after the client has it
    with httpx.Client() as client:
        expected = [send_innocent(client, router.url, p, b) for p, b in INNOCENT]
    innocent = InnocentLoop(router.url, expected)
    thread = threading.Thread(target=innocent.run, name="innocent", daemon=True)
    statuses: Counter = Counter()
    v1_statuses: Counter = Counter({200: len(INNOCENT)})  # the clean run's
    client = httpx.Client()

    def hostile_round(round_seed: int) -> None:
        @seed(round_seed)
        @settings(
            max_examples=examples, deadline=None, database=None,
            suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        @given(request=hostile_request())
        def one(request: tuple[str, bytes, dict[str, str], bool]) -> None:
            path, body, headers, leaves = request
            with client.stream(
                "POST", router.url + path, content=body, headers=headers,
                timeout=CLIENT_TIMEOUT_S,
            ) as response:  # fmt: skip
                if leaves and response.status_code == 200:
                    next(response.iter_raw(), None)  # the first chunk, then the client goes
                else:
                    response.read()
            if response.request.url.raw_path.startswith(b"/v1/"):
                v1_statuses[response.status_code] += 1
            statuses[response.status_code] += 1
            context = f"seed {round_seed}: POST {path} -> {response.status_code}: {body[:600]!r}"
            assert response.status_code < 500, f"{context}\n{response.text[:500]}"
            if response.status_code >= 400:
                assert "error" in response.json(), context

        one()

    thread.start()
    try:
        began, rounds = time.monotonic(), 0
        while rounds == 0 or (seconds is not None and time.monotonic() - began < seconds):
            hostile_round(run_seed + rounds)
            rounds += 1
    finally:
        innocent.stop.set()
        thread.join(CLIENT_TIMEOUT_S)
        client.close()
    v1_statuses[200] += innocent.sent
    print(f"innocent requests: {innocent.sent}, {len(innocent.wrong)} not equal to their clean run")
    assert not innocent.wrong, f"seed {run_seed}: " + "\n".join(innocent.wrong[:5])
    assert innocent.sent >= len(INNOCENT)

    until_sync(lambda: _router_idle(router.url), "the router holding no admitted request")
    states = cluster.wait_quiescent()
    assert all(s.quiescent for s in states.values()), states
    until_sync(
        lambda: _access_lines(_new_lines(offsets)[router.log]) >= sum(v1_statuses.values()),
        "an access-log line for every /v1 request",
    )
    lines = _new_lines(offsets)
    for path, text in lines.items():
        assert not [ln for ln in text if "Traceback" in ln], f"seed {run_seed}: traceback in {path}"
    router_lines = [json.loads(ln) for ln in lines[router.log] if ln]  # each line parses
    access = [r for r in router_lines if r.get("logger") == "pdd.router.access"]
    logged = Counter(r.get("status") for r in access)
    assert logged == v1_statuses, f"access-log lines by status {logged}, requests {v1_statuses}"
    return statuses


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_hostile_requests_leave_innocent_ones_untouched(router, cluster) -> None:
    statuses = run_hostile(router, cluster, FAST_EXAMPLES, None)
    print(f"hostile statuses: {dict(statuses)}")
    assert sum(statuses.values()) >= FAST_EXAMPLES
    assert statuses[200] > 0 and statuses[400] > 0  # some were served, some refused


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
def test_hostile_requests_for_long(router, cluster) -> None:
    seconds = float(os.environ.get("PDD_HOSTILE_FUZZ_S", LONG_DEFAULT_S))
    statuses = run_hostile(router, cluster, LONG_ROUND_EXAMPLES, seconds)
    print(f"hostile statuses over {seconds:.0f} s: {dict(statuses)}")
    assert sum(statuses.values()) > 0
