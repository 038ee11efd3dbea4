"""Logit bias, min_tokens, penalties and logprobs against straightforward references."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from pydantic import ValidationError
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from pdd.worker.engine import Engine
from pdd.worker.engine.request import RequestError
from pdd.worker.engine.sampling import (
    LOGPROB_FLOOR,
    SamplingParams,
    apply_penalties,
    process_logits,
    sample,
    token_logprobs,
)

pytestmark = pytest.mark.unit

VOCAB = 40
EOS = (3,)


@dataclass
class Hist:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_matches_hf() -> None:
    hist = Hist([1, 2, 2, 7, 30], [7, 9, 11, 1])
    logits = _logits(0)
    for penalty in (0.5, 1.3, 2.0):
        ours = apply_penalties(logits, [SamplingParams(repetition_penalty=penalty)], [hist])
        hf = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([hist.prompt_ids + hist.output_ids]), logits.clone()
        )
        torch.testing.assert_close(ours, hf)


def test_frequency_and_presence_count_output_tokens_only() -> None:
    hist = Hist([5, 5, 5, 6], [6, 8, 8, 8, 2])
    logits = _logits(1)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.5)
    ours = apply_penalties(logits, [params], [hist])
    expected = logits.clone()
    for token in set(hist.output_ids):
        n = hist.output_ids.count(token)
        expected[0, token] -= 0.5 * n + 1.5
    torch.testing.assert_close(ours, expected)  # prompt-only token 5 is untouched


def test_batched_penalties_equal_row_by_row() -> None:
    params = [
        SamplingParams(repetition_penalty=1.2, frequency_penalty=-0.4),
        SamplingParams(presence_penalty=2.0),
        SamplingParams(repetition_penalty=0.7, presence_penalty=-1.0, frequency_penalty=1.0),
    ]
    hists = [Hist([1, 2, 3], [4, 4]), Hist([9], []), Hist([10, 11, 12, 13, 14], [1, 1, 1, 39])]
    logits = _logits(2, rows=3)
    batched = apply_penalties(logits, params, hists)
    for row in range(3):
        alone = apply_penalties(logits[row : row + 1], [params[row]], [hists[row]])
        torch.testing.assert_close(batched[row : row + 1], alone)


def test_process_logits_leaves_plain_rows_alone_and_biases_others() -> None:
    logits = _logits(3, rows=2)
    params = [SamplingParams(), SamplingParams(logit_bias=((4, 100.0), (5, -100.0), (4, 1.0)))]
    out = process_logits(logits, params, [Hist([1]), Hist([1])], EOS)
    assert torch.equal(out[0], logits[0])
    expected = logits[1].clone()
    expected[4] += 101.0
    expected[5] -= 100.0
    torch.testing.assert_close(out[1], expected)
    assert sample(out[1:], params[1:], [0], [0]) == [4]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 50.0  # EOS would win
    logits[0, 8] = 40.0  # then the stop token
    params = SamplingParams(min_tokens=2, stop_token_ids=(8,))
    early = process_logits(logits, [params], [Hist([1], [6])], EOS)
    assert early[0, 3] == early[0, 8] == float("-inf")
    done = process_logits(logits, [params], [Hist([1], [6, 6])], EOS)
    assert torch.equal(done, logits)
    ignoring = process_logits(
        logits, [SamplingParams(min_tokens=5, ignore_eos=True)], [Hist([1])], EOS
    )
    assert ignoring[0, 3] == 50.0  # EOS is no stop under ignore_eos: not masked


def test_prior_output_in_the_prompt_counts_as_output() -> None:
    """A resumed request carries its earlier output at the end of its prompt: penalties
    and ``min_tokens`` read the same history as the unbroken request."""
    logits = _logits(5)
    logits[0, 3] = 50.0  # EOS would win
    unbroken = Hist([5, 5, 6], [6, 8, 8, 3])
    resumed = Hist([5, 5, 6, 6, 8], [8, 3])
    for kw in (
        {"frequency_penalty": 0.7, "presence_penalty": -1.2, "repetition_penalty": 1.4},
        {"min_tokens": 5, "presence_penalty": 0.3},
    ):
        whole = process_logits(logits, [SamplingParams(**kw)], [unbroken], EOS)
        again = process_logits(
            logits, [SamplingParams(**kw, prior_output_tokens=2)], [resumed], EOS
        )
        torch.testing.assert_close(again, whole)
        as_prompt = process_logits(logits, [SamplingParams(**kw)], [resumed], EOS)
        assert not torch.equal(as_prompt, whole)  # without the field, the history differs


def test_logprobs_are_the_log_softmax_with_the_top_alternatives() -> None:
    logits = _logits(4, rows=3)
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=0)]
    tokens = [7, 1, 2]
    out = token_logprobs(logits, tokens, params)
    reference = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    assert out[0] is not None and out[2] is not None
    assert out[0].logprob == pytest.approx(reference[0, 7].item(), abs=1e-6)
    assert out[2].logprob == pytest.approx(reference[2, 2].item(), abs=1e-6) and not out[2].top
    values, ids = reference[0].topk(3)
    assert [t.token_id for t in out[0].top] == ids.tolist()
    assert [t.logprob for t in out[0].top] == pytest.approx(values.tolist(), abs=1e-6)


def test_masked_logprobs_are_floored_not_minus_infinity() -> None:
    logits = torch.full((1, 4), float("-inf"))
    logits[0, 0] = 0.0
    (out,) = token_logprobs(logits, [0], [SamplingParams(logprobs=2)])
    assert out is not None and out.logprob == 0.0
    assert out.top[1].logprob == LOGPROB_FLOOR


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"prior_output_tokens": -1}, "prior_output_tokens"),
    ],
)
def test_out_of_range_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**kwargs)


def test_engine_applies_penalties_and_reports_logprobs(tiny) -> None:
    engine = Engine(tiny, block_size=4, num_blocks=256)
    prompt = list(range(10, 30))
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    strict = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=2.0,
                            frequency_penalty=2.0, logprobs=2)  # fmt: skip
    plain_out, steered = engine.generate([prompt, prompt], [plain, strict])
    assert plain_out != steered  # random weights repeat themselves; penalties change that
    assert len(set(steered)) > len(set(plain_out))
    rid = engine.add_request(prompt, strict)
    logprobs = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
                logprobs.extend(out.logprobs)
    assert len(logprobs) == 12
    assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in logprobs)
    assert all(lp.top[0].logprob >= lp.logprob for lp in logprobs)  # greedy: the top is picked


STEERED = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "min_tokens": 18,
           "stop_token_ids": (7,), "logit_bias": ((7, 6.0),)}  # fmt: skip


@pytest.mark.parametrize("repetition", [1.0, 1.3])
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("broken_at", [1, 5, 13])
def test_a_resumed_request_continues_the_unbroken_output(
    tiny, repetition, seeded, broken_at
) -> None:
    """What the router's resume sends an engine (prompt + the tokens already sent, the
    count in ``prior_output_tokens``, what is left of ``max_tokens``) makes the rest of
    the unbroken output, token for token, under penalties, ``min_tokens`` and a seed.
    (Greedy with frequency/presence alone is the case that fails when the tokens sent are
    counted as prompt; a repetition penalty covers prompt and output alike.)"""
    engine = Engine(tiny, block_size=4, num_blocks=256)
    prompt = list(range(40, 60))
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 7} if seeded else {}
    steered = {**STEERED, "repetition_penalty": repetition}
    [whole] = engine.generate([prompt], SamplingParams(max_tokens=20, **sampled, **steered))
    [plain] = engine.generate([prompt], SamplingParams(max_tokens=20, **sampled))
    assert whole != plain and len(whole) >= 18  # the options change the output
    sent = whole[:broken_at]
    resumed = SamplingParams(
        max_tokens=20 - broken_at, prior_output_tokens=broken_at, **sampled, **steered
    )
    [rest] = engine.generate([prompt + sent], resumed)
    assert sent + rest == whole
    with pytest.raises(RequestError, match="prior_output_tokens"):
        engine.add_request(prompt, SamplingParams(prior_output_tokens=len(prompt)))


def test_requests_without_options_take_the_plain_path(tiny, monkeypatch) -> None:
    """No bias, penalty, min_tokens or logprobs in the batch: the logits go straight to
    the sampler (the steering and logprob code never runs)."""
    import pdd.worker.engine.engine as engine_module

    def forbidden(*args: object) -> None:
        raise AssertionError("the plain path must not process logits")

    monkeypatch.setattr(engine_module, "process_logits", forbidden)
    monkeypatch.setattr(engine_module, "token_logprobs", forbidden)
    engine = Engine(tiny, block_size=4, num_blocks=64)
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    params = [plain, SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, seed=1)]
    assert all(len(out) == 4 for out in engine.generate([[1, 2, 3], [4, 5]], params))
