"""Every sampling field reaches vLLM, is refused with a reason, or is handled by the role
engine: a field added to ``SamplingSpec`` fails here until ``pdd.worker.vllm.sampling``
says what vLLM does with it (never silently dropped). No vLLM needed."""

from __future__ import annotations

import pytest

from pdd.common.wire import SamplingSpec
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.vllm.sampling import (
    PRIOR_PENALTIES_KEY,
    VllmSamplingError,
    check_handoff,
    vllm_sampling_kwargs,
)

from ..roles.test_sampling_params import EVERY_FIELD

pytestmark = pytest.mark.unit

#: Fields the vLLM path handles outside the keyword mapping, and where.
HANDLED_ELSEWHERE = {
    # role_engine puts the earlier output in the prompt and counts it off max_tokens;
    # vllm_sampling_kwargs counts it off min_tokens and hands the penalties over it to
    # PriorOutputPenalties (test_resumed_* below).
    "prior_output_tokens",
}


@pytest.mark.parametrize("name", sorted(SamplingSpec.model_fields))
def test_each_field_is_mapped_refused_or_handled(name: str) -> None:
    if name in HANDLED_ELSEWHERE:
        return
    changed = SamplingParams.of(SamplingSpec(), **{name: getattr(EVERY_FIELD, name)})
    try:
        mapped = vllm_sampling_kwargs(changed)
    except VllmSamplingError:
        return  # refused with a reason
    assert mapped != vllm_sampling_kwargs(SamplingParams()), (
        f"{name} changes nothing vLLM is given: map it in vllm_sampling_kwargs, refuse it "
        "in check_supported, or name it in HANDLED_ELSEWHERE with where it is handled"
    )


def test_a_resumed_requests_penalties_go_to_the_processor_and_vllms_are_neutral() -> None:
    resumed = SamplingParams(
        prior_output_tokens=2, presence_penalty=0.5, frequency_penalty=-0.25,
        repetition_penalty=1.3,
    )  # fmt: skip
    mapped = vllm_sampling_kwargs(resumed, {"move": 1})
    assert (mapped["presence_penalty"], mapped["frequency_penalty"]) == (0.0, 0.0)
    assert mapped["repetition_penalty"] == 1.0
    assert mapped["extra_args"] == {
        "kv_transfer_params": {"move": 1},
        PRIOR_PENALTIES_KEY: {
            "prior_output_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -0.25,
            "repetition_penalty": 1.3,
        },
    }  # fmt: skip


def test_vllm_applies_the_penalties_itself_where_there_is_no_earlier_output() -> None:
    fresh = vllm_sampling_kwargs(SamplingParams(presence_penalty=0.5, repetition_penalty=1.3))
    assert (fresh["presence_penalty"], fresh["repetition_penalty"]) == (0.5, 1.3)
    assert fresh["extra_args"] is None
    unpenalized = vllm_sampling_kwargs(SamplingParams(prior_output_tokens=3))
    assert unpenalized["extra_args"] is None


@pytest.mark.parametrize(
    ("min_tokens", "max_tokens", "prior", "left"),
    [(5, 9, 2, 3), (5, 9, 5, 0), (2, 9, 4, 0), (20, 1, 0, 1), (20, 6, 8, 6)],
)
def test_a_resumed_request_needs_only_the_rest_of_min_tokens_and_never_over_max_tokens(
    min_tokens: int, max_tokens: int, prior: int, left: int
) -> None:
    """vLLM masks the stop tokens while its own output is shorter than ``min_tokens``, and
    refuses ``min_tokens`` over ``max_tokens`` (P samples one token of any request)."""
    resumed = SamplingParams(
        min_tokens=min_tokens, max_tokens=max_tokens, prior_output_tokens=prior
    )
    assert vllm_sampling_kwargs(resumed)["min_tokens"] == left


def test_a_handoff_of_a_seeded_request_at_temperature_is_refused_greedy_or_unseeded_is_not() -> (
    None
):
    seeded = SamplingParams(temperature=0.8, seed=7)
    with pytest.raises(VllmSamplingError, match="seeded"):
        check_handoff(seeded)
    check_handoff(seeded.with_changes(temperature=0.0))  # greedy
    check_handoff(seeded.with_changes(top_k=1))  # one token left: greedy too
    check_handoff(seeded.with_changes(seed=None))  # nothing promised to carry
    vllm_sampling_kwargs(seeded)  # one instance samples it all: vLLM's own seed


def test_a_resumed_seeded_request_goes_on_with_a_seed_derived_from_the_tokens_sent() -> None:
    """The router's resume after a failure: the rest is drawn afresh, the same every run,
    and another number of tokens sent draws differently."""
    seeded = SamplingParams(prior_output_tokens=2, temperature=0.8, seed=7)
    seed = vllm_sampling_kwargs(seeded)["seed"]
    assert seed == vllm_sampling_kwargs(seeded.with_changes())["seed"]
    assert seed not in (7, vllm_sampling_kwargs(seeded.with_changes(prior_output_tokens=3))["seed"])
    assert 0 <= seed < 2**63
    for kept in ({"prior_output_tokens": 0}, {"temperature": 0.0}, {"top_k": 1}):
        assert vllm_sampling_kwargs(seeded.with_changes(**kept))["seed"] == 7, kept
    assert vllm_sampling_kwargs(seeded.with_changes(seed=None))["seed"] is None
