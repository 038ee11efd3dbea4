"""``PriorOutputPenalties`` (pdd.worker.vllm.prior_penalties) against vLLM's own penalties
on one unbroken request: a resumed request's row, penalized by the processor and then by
vLLM's neutral penalties, is bit for bit the row vLLM alone penalizes, with the earlier
output as output. In-process, on vLLM's own functions; no engine started. The whole
handoff on a real vLLM is ``test_vllm_handoff_sampling.py``'s.
"""

from __future__ import annotations

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

import torch
from vllm import SamplingParams as VllmSamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.ops.penalties import apply_all_penalties

from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.vllm.prior_penalties import PriorOutputPenalties
from pdd.worker.vllm.sampling import vllm_sampling_kwargs

pytestmark = pytest.mark.unit

VOCAB = 50
PROMPT = [3, 7, 7, 11, 20]
PRIOR = [7, 30, 30, 4]  # the earlier output: handed over, now the prompt's tail
OWN = [30, 9]  # what vLLM sampled itself since


def penalties(presence: float, frequency: float, repetition: float) -> list[torch.Tensor]:
    return [torch.tensor([v], dtype=torch.float32) for v in (presence, frequency, repetition)]


def vllm_penalizes(
    row: torch.Tensor, prompt: list[int], output: list[int], spec: dict[str, float]
) -> torch.Tensor:
    """vLLM's sampler's penalty step on one row, with ``spec`` as vLLM was given it."""
    presence, frequency, repetition = penalties(
        spec["presence_penalty"], spec["frequency_penalty"], spec["repetition_penalty"]
    )
    return apply_all_penalties(
        row.clone(), torch.tensor([prompt]), presence, frequency, repetition, [output]
    )


@pytest.mark.parametrize(
    "spec",
    [
        {"presence_penalty": 0.7, "frequency_penalty": 0.0, "repetition_penalty": 1.0},
        {"presence_penalty": 0.0, "frequency_penalty": 0.3, "repetition_penalty": 1.0},
        {"presence_penalty": -0.4, "frequency_penalty": 1.1, "repetition_penalty": 1.3},
        {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 0.8},
    ],
)
def test_a_resumed_row_is_penalized_as_one_unbroken_vllm_request(spec: dict[str, float]) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB, dtype=torch.float32) * 4
    alone = vllm_penalizes(logits[1:2], PROMPT, [*PRIOR, *OWN], spec)

    resumed = SamplingParams(prior_output_tokens=len(PRIOR), max_tokens=8, **spec)
    kwargs = vllm_sampling_kwargs(resumed)
    processor = PriorOutputPenalties(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    plain = VllmSamplingParams(max_tokens=8)
    processor.update_state(
        BatchUpdate(
            batch_size=3,
            removed=[],
            added=[
                (0, plain, [1, 2], [5]),
                (1, VllmSamplingParams(**kwargs), [*PROMPT, *PRIOR], OWN),
                (2, plain, [4], []),
            ],
            moved=[],
        )
    )
    out = processor.apply(logits.clone())
    out[1:2] = vllm_penalizes(out[1:2], [*PROMPT, *PRIOR], OWN, kwargs)  # vLLM's own, neutral
    assert torch.equal(out[1:2], alone)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])  # not its rows


def test_without_the_processor_vllm_misses_the_earlier_output() -> None:
    """What the processor is for: vLLM given the penalties itself counts only ``OWN``."""
    spec = {"presence_penalty": 0.7, "frequency_penalty": 0.3, "repetition_penalty": 1.0}
    row = torch.randn(1, VOCAB, dtype=torch.float32) * 4
    alone = vllm_penalizes(row, PROMPT, [*PRIOR, *OWN], spec)
    assert not torch.equal(vllm_penalizes(row, [*PROMPT, *PRIOR], OWN, spec), alone)


def test_a_moved_request_keeps_its_row() -> None:
    """vLLM compacts its batch by moving requests; the penalties follow."""
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality

    spec = {"presence_penalty": 0.0, "frequency_penalty": 0.9, "repetition_penalty": 1.0}
    resumed = SamplingParams(prior_output_tokens=len(PRIOR), max_tokens=8, **spec)
    kwargs = vllm_sampling_kwargs(resumed)
    processor = PriorOutputPenalties(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    added = (2, VllmSamplingParams(**kwargs), [*PROMPT, *PRIOR], OWN)
    processor.update_state(BatchUpdate(3, [], [added], []))
    processor.update_state(BatchUpdate(1, [0], [], [(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    logits = torch.randn(1, VOCAB, dtype=torch.float32)
    alone = vllm_penalizes(logits, PROMPT, [*PRIOR, *OWN], spec)
    assert torch.equal(processor.apply(logits.clone()), alone)
