"""The sampling fields are written once: the wire's ``SamplingSpec`` is what the engine
samples by, so a field added there reaches every role's engine with no copy to extend."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdd.common.vocabulary import Pipeline
from pdd.common.wire import Endpoint, GuidedDecoding, PipelinePlan, SamplingSpec
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.roles.base import sampling_params

pytestmark = pytest.mark.unit

#: Every field away from its default, so a field a conversion drops shows as a difference.
EVERY_FIELD = SamplingSpec(
    max_tokens=40,
    temperature=0.7,
    top_k=5,
    top_p=0.9,
    seed=11,
    stop_token_ids=(7, 8),
    ignore_eos=True,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.2,
    min_tokens=3,
    logit_bias=((4, 2.0),),
    logprobs=2,
    prior_output_tokens=1,
    guided=GuidedDecoding(kind="json_object"),
)
MAIN = Endpoint(instance_id="md", http_url="http://md:80", fast_addr="md:90", wan_addr="md:91")
PLAN = PipelinePlan(
    request_id="r", prompt_ids=[1, 2, 3], sampling=EVERY_FIELD, pipeline=Pipeline.MONO, main=MAIN
)


def test_the_example_sets_every_field_of_the_spec() -> None:
    defaults = dict(SamplingSpec())
    same = [name for name, value in dict(EVERY_FIELD).items() if value == defaults[name]]
    assert same == [], f"set these fields in EVERY_FIELD too: {same}"


def test_the_engine_declares_the_spec_fields_and_defaults_and_no_other() -> None:
    def declared(model: type[SamplingSpec]) -> dict[str, str]:
        return {name: repr(info) for name, info in model.model_fields.items()}

    assert declared(SamplingParams) == declared(SamplingSpec)
    assert dict(SamplingParams()) == dict(SamplingSpec())


def test_every_spec_field_reaches_the_engine() -> None:
    assert dict(sampling_params(PLAN)) == dict(EVERY_FIELD)


def test_prefill_caps_only_max_tokens() -> None:
    assert dict(sampling_params(PLAN, max_tokens=1)) == {**dict(EVERY_FIELD), "max_tokens": 1}


def test_the_engine_checks_what_the_wire_checks() -> None:
    """Parameters built in the worker (``pdd generate``, a handoff's remaining tokens) are
    held to the wire's ranges, which name the field."""
    with pytest.raises(ValidationError, match="logit_bias"):
        SamplingParams(logit_bias=((-1, 1.0),))
    with pytest.raises(ValidationError, match="max_tokens"):
        SamplingParams(max_tokens=3).with_changes(max_tokens=0)
