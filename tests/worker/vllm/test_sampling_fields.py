"""Every sampling field reaches vLLM, is refused with a reason, or is handled by the role
engine: a field added to ``SamplingSpec`` fails here until ``pdd.worker.vllm.sampling``
says what vLLM does with it (never silently dropped). No vLLM needed."""

from __future__ import annotations

import pytest

from pdd.common.wire import SamplingSpec
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.vllm.sampling import VllmSamplingError, vllm_sampling_kwargs

from ..roles.test_sampling_params import EVERY_FIELD

pytestmark = pytest.mark.unit

#: Fields the vLLM path handles outside the keyword mapping, and where.
HANDLED_ELSEWHERE = {
    # role_engine puts the earlier output in the prompt and counts it off max_tokens;
    # check_supported refuses it where penalties or min_tokens would count it.
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


def test_a_resumed_request_with_penalties_is_refused() -> None:
    resumed = SamplingParams(prior_output_tokens=2, presence_penalty=0.5)
    with pytest.raises(VllmSamplingError, match="prior_output_tokens"):
        vllm_sampling_kwargs(resumed)
