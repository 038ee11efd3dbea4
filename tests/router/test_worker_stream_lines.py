"""A worker's stream line the router cannot read fails that source, never the router."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import httpx
import pytest

from pdd.common.wire import TokenEvent, TokenLogprobs
from pdd.router.openai_protocol import CompletionRequest
from pdd.router.worker_client import WorkerCallError, WorkerClient, _token_event

pytestmark = pytest.mark.unit

URL = "http://p:1/v1/pdd/requests/r/stream"


def test_a_token_event_line_is_read() -> None:
    event = TokenEvent(request_id="r", seq=0, token_id=5, source="md")
    assert _token_event(URL, event.model_dump_json()) == event


def test_a_nan_logprob_line_is_a_worker_call_error_naming_the_stream() -> None:
    # NaN serializes as null, which no reader takes back as a float: the line is refused
    # as this source's failure (the relay routes around it) rather than escaping.
    bad = TokenEvent(
        request_id="r", seq=0, token_id=5, source="md", logprobs=TokenLogprobs(logprob=math.nan)
    )
    with pytest.raises(WorkerCallError, match="not a token event") as e:
        _token_event(URL, bad.model_dump_json())
    assert URL in str(e.value)


@pytest.mark.parametrize("value", [5e-324, 0.0, 1e9])
def test_a_repetition_penalty_that_would_overflow_the_logits_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="repetition_penalty"):
        CompletionRequest(model="m", prompt="x", repetition_penalty=value)


def _body(*chunks: bytes) -> httpx.MockTransport:
    """A worker whose stream body arrives in exactly these chunks."""

    async def stream(_: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        return httpx.Response(200, content=body())

    return httpx.MockTransport(stream)


async def _read(*chunks: bytes) -> list[int]:
    client = WorkerClient("s", transport=_body(*chunks))
    try:
        return [e.token_id async for e in client.stream("http://md:1", "r")]
    finally:
        await client.aclose()


def _line(token: int) -> bytes:
    return TokenEvent(request_id="r", seq=token, token_id=token, source="md").model_dump_json(
    ).encode()  # fmt: skip


async def test_stream_lines_are_read_whole_however_the_chunks_cut_them() -> None:
    a, b, c = _line(1), _line(2), _line(3)
    whole = a + b"\n" + b + b"\n" + c + b"\n"
    assert await _read(whole) == [1, 2, 3]  # several lines in one chunk
    assert await _read(*(whole[i : i + 7] for i in range(0, len(whole), 7))) == [1, 2, 3]
    assert await _read(a + b"\n\n", b"\r\n", b" \n" + c) == [1, 3]  # blank lines; no last \n
    assert await _read(a[:5], a[5:], b"\n" + b[:-1], b[-1:] + b"\n") == [1, 2]


async def test_a_line_cut_short_by_the_stream_s_end_fails_the_source() -> None:
    with pytest.raises(WorkerCallError, match="not a token event"):
        await _read(_line(1) + b"\n" + _line(2)[:10])


async def test_the_lines_are_read_off_the_transport_s_body(monkeypatch: pytest.MonkeyPatch) -> None:
    # httpx's ``aiter_raw`` passes every chunk, a token event each, through a context
    # manager, a chunker and a byte count the router has no use for (docs/router-scale.md).
    wrapped = 0
    aiter_raw = httpx.Response.aiter_raw

    def counting(self: httpx.Response, chunk_size: int | None = None) -> AsyncIterator[bytes]:
        nonlocal wrapped
        wrapped += 1
        return aiter_raw(self, chunk_size)

    monkeypatch.setattr(httpx.Response, "aiter_raw", counting)
    assert await _read(_line(1) + b"\n", _line(2) + b"\n") == [1, 2]
    assert wrapped == 0
