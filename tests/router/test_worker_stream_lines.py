"""A worker's stream line the router cannot read fails that source, never the router."""

from __future__ import annotations

import math

import pytest

from pdd.common.openai_protocol import CompletionRequest
from pdd.common.wire import TokenEvent, TokenLogprobs
from pdd.router.worker_client import WorkerCallError, _token_event

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
