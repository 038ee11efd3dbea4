"""Sampling: greedy, filters, and the (seed, position) purity the relay handoff relies on."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from pydantic import ValidationError

from pdd.worker.engine import Engine
from pdd.worker.engine.sampling import (
    SamplingParams,
    sample,
    sample_one,
    uniform,
)

pytestmark = pytest.mark.unit

VOCAB = 50


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_uniform_is_a_pure_function_of_seed_and_position() -> None:
    assert uniform(7, 3) == uniform(7, 3)
    values = {uniform(seed, pos) for seed in range(20) for pos in range(20)}
    assert len(values) == 400
    assert all(0 <= v < 1 for v in values)


def test_same_seed_and_position_pick_the_same_token_in_any_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    row = _logits(0)
    alone = sample(row, [params], [11], [5])[0]
    others = _logits(1, rows=3)
    mixed = torch.cat([others[:2], row, others[2:]])
    mates = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5), params, params]
    batch = sample(mixed, mates, [1, 2, 11, 3], [9, 9, 5, 9])
    assert batch[2] == alone


def test_draws_follow_the_distribution_and_differ_across_seeds() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(3)
    for seed in range(3000):
        counts[sample_one(logits, params, seed, position=4)] += 1
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.5, 0.3, 0.2]), atol=0.04)
    flat = torch.zeros(VOCAB)
    picks = {sample_one(flat, params, seed, 0) for seed in range(40)}
    assert len(picks) > 10  # different seeds give different tokens


def test_positions_of_one_request_get_independent_draws() -> None:
    flat = torch.zeros(VOCAB)
    picks = [sample_one(flat, SamplingParams(temperature=1.0), 3, pos) for pos in range(40)]
    assert len(set(picks)) > 10


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=1.3, top_p=1e-6),
        SamplingParams(temperature=0.0, top_k=7, top_p=0.5),
    ],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(2, rows=8)
    greedy = torch.argmax(logits, dim=-1).tolist()
    assert sample(logits, [params] * 8, list(range(8)), [0] * 8) == greedy
    assert [sample_one(logits[i], params, 99, i) for i in range(8)] == greedy


def test_top_k_and_top_p_only_pick_inside_the_filter() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05]))
    top_k = {sample_one(logits, SamplingParams(temperature=1.0, top_k=2), s, 0) for s in range(200)}
    assert top_k == {0, 1}
    top_p = {
        sample_one(logits, SamplingParams(temperature=1.0, top_p=0.8), s, 0) for s in range(300)
    }
    assert top_p == {0, 1, 2}  # 0.4 + 0.3 < 0.8, so the 0.2 token is needed too


def test_top_p_ties_keep_vocabulary_order() -> None:
    logits = torch.zeros(4)
    picks = {
        sample_one(logits, SamplingParams(temperature=1.0, top_p=0.5), s, 0) for s in range(100)
    }
    assert picks == {0, 1}


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 0), ("temperature", -0.1), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5)],
)
def test_out_of_range_params_raise_a_typed_error_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


def test_seeded_sampling_is_reproducible_across_engines_and_batches(
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = [10, 20, 30, 40, 50]
    first = Engine("tiny", block_size=4, num_blocks=128)
    alone = first.generate([prompt], params)[0]
    second = Engine(first.loaded, block_size=8, num_blocks=64)
    batch = [[5, 6, 7], prompt, list(range(60, 100))]
    crowd = second.generate(batch, [SamplingParams(max_tokens=30), params, params])
    assert crowd[1] == alone
    other_seed = SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True
    )
    assert first.generate([prompt], other_seed)[0] != alone
    greedy = first.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    top1 = SamplingParams(max_tokens=24, temperature=0.9, top_k=1, seed=5, ignore_eos=True)
    assert first.generate([prompt], top1)[0] == greedy
    for engine in (first, second):
        assert_no_leaks(engine)
