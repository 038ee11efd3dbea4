"""Wire schemas: plans validate their pipeline's stages; events and reports round-trip."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdd.common.wire import (
    CacheEventsPage,
    Endpoint,
    LoadReport,
    PipelinePlan,
    SamplingSpec,
    StateReport,
    TokenEvent,
    TokenLogprobs,
    TopLogprob,
)

pytestmark = pytest.mark.unit


def endpoint(name: str) -> Endpoint:
    return Endpoint(instance_id=name, http_url=f"http://{name}", fast_addr="h:1", wan_addr="h:2")


def test_plan_round_trips_through_json() -> None:
    plan = PipelinePlan(
        request_id="r1",
        prompt_ids=[1, 2, 3],
        sampling=SamplingSpec(max_tokens=8, temperature=0.7, seed=5),
        pipeline="P-RLD-MD",
        prefill=endpoint("p"),
        relay=endpoint("rld"),
        main=endpoint("md"),
        handoff="catch-up",
    )
    again = PipelinePlan.model_validate_json(plan.model_dump_json())
    assert again == plan
    assert [e.instance_id for e in again.decode_sources] == ["rld", "md"]


@pytest.mark.parametrize(
    ("pipeline", "given", "missing"),
    [
        ("P-RLD-MD", ("prefill", "main"), "relay"),
        ("P-MD", ("main",), "prefill"),
        ("P-RLD", ("prefill", "main"), "relay"),
        ("mono", ("prefill",), "main"),
    ],
)
def test_plan_names_the_missing_stage(pipeline: str, given: tuple[str, ...], missing: str) -> None:
    kwargs = {stage: endpoint(stage) for stage in given}
    with pytest.raises(ValidationError, match=f"needs endpoints for: .*{missing}"):
        PipelinePlan(request_id="r", prompt_ids=[1], pipeline=pipeline, **kwargs)


def test_decode_sources_per_pipeline() -> None:
    eps = {s: endpoint(s) for s in ("prefill", "relay", "main")}
    names = {
        p: [
            e.instance_id
            for e in PipelinePlan(request_id="r", prompt_ids=[1], pipeline=p, **eps).decode_sources
        ]
        for p in ("P-RLD-MD", "P-MD", "P-RLD", "mono", "naive")
    }
    assert names == {
        "P-RLD-MD": ["relay", "main"],
        "P-MD": ["main"],
        "P-RLD": ["relay"],
        "mono": ["main"],
        "naive": ["main"],
    }


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValidationError):
        SamplingSpec(max_tokens=0)
    with pytest.raises(ValidationError):
        PipelinePlan(request_id="r", prompt_ids=[], pipeline="mono", main=endpoint("m"))
    with pytest.raises(ValidationError):
        SamplingSpec(prior_output_tokens=-1)
    resumed = SamplingSpec(prior_output_tokens=2)
    PipelinePlan(request_id="r", prompt_ids=[1, 2, 3], sampling=resumed, main=endpoint("m"),
                 pipeline="mono")  # fmt: skip
    with pytest.raises(ValidationError, match="prior_output_tokens"):  # no prompt left
        PipelinePlan(request_id="r", prompt_ids=[1, 2], sampling=resumed, main=endpoint("m"),
                     pipeline="mono")  # fmt: skip
    load = dict(
        instance_id="i",
        role="relay",
        running=0,
        waiting=0,
        kv_blocks_free=1,
        kv_blocks_total=1,
        relay_load=0.5,
        capacity=4,
    )
    LoadReport(**load)
    with pytest.raises(ValidationError, match="relay_load"):
        LoadReport(**{**load, "relay_load": 1.5})
    with pytest.raises(ValidationError, match="capacity"):
        LoadReport(**{**load, "capacity": 0})
    with pytest.raises(ValidationError, match="cached_tokens"):
        TokenEvent(request_id="r", seq=0, token_id=5, source="p", cached_tokens=-1)


def test_token_event_kinds() -> None:
    token = TokenEvent(request_id="r", seq=0, token_id=5, source="rld")
    status = TokenEvent(request_id="r", seq=4, source="md", error="gone")
    assert token.is_token and not status.is_token
    assert TokenEvent.model_validate_json(status.model_dump_json()) == status


def test_state_report_quiescence() -> None:
    base = dict(
        instance_id="i",
        live_requests=0,
        engine_requests=0,
        kv_blocks_free=6,
        kv_blocks_cached=2,
        kv_blocks_locked=0,
        kv_blocks_total=8,
    )
    assert StateReport(**base).quiescent
    assert not StateReport(**{**base, "kv_blocks_locked": 1}).quiescent
    assert not StateReport(**{**base, "kv_blocks_free": 5}).quiescent
    assert not StateReport(**{**base, "live_requests": 1}).quiescent


def test_cache_events_page_parses_events_by_type() -> None:
    raw = {
        "instance_id": "md",
        "next_cursor": 2,
        "events": [
            {"type": "block_stored", "block_hashes": [1, 2], "parent_hash": None, "block_size": 16},
            {"type": "block_removed", "block_hashes": [2]},
        ],
    }
    page = CacheEventsPage.model_validate(raw)
    assert [type(e).__name__ for e in page.events] == ["BlockStored", "BlockRemoved"]


def test_steering_and_logprobs_round_trip_and_are_checked() -> None:
    spec = SamplingSpec(
        presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.3, min_tokens=4,
        logit_bias=((7, -100.0), (9, 3.5)), logprobs=20,
    )  # fmt: skip
    assert SamplingSpec.model_validate_json(spec.model_dump_json()) == spec
    for bad in (
        {"presence_penalty": 2.1},
        {"repetition_penalty": 0.0},
        {"min_tokens": -1},
        {"logprobs": 21},
        {"logit_bias": ((7, 100.5),)},
        {"logit_bias": ((-1, 1.0),)},
    ):
        with pytest.raises(ValidationError):
            SamplingSpec(**bad)
    lp = TokenLogprobs(logprob=-0.5, top=(TopLogprob(token_id=3, logprob=-0.5),))
    event = TokenEvent(request_id="r", seq=0, token_id=3, source="md", logprobs=lp)
    assert TokenEvent.model_validate_json(event.model_dump_json()).logprobs == lp
