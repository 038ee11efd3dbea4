"""The engine against transformers ``generate`` on checkpoints transformers wrote.

Greedy 64-token generations must be identical, with continuous batching doing
real work: staggered arrivals (prefills join running decodes), a small token
budget (the long prompt is chunked), a prefix-cache hit on the second run, and
through ``pdd generate``'s ``main()``. Every test ends with no leaked block or lock.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdd.worker import generate_cli
from pdd.worker.engine import Engine
from pdd.worker.engine.request import FinishReason, RequestOutput
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.loader import LoadedModel

pytestmark = pytest.mark.unit

NEW_TOKENS = 64
BUDGET = 32  # tokens per step: the 150-token prompt takes 5 chunks
PROMPT_LENS = (5, 23, 150, 41)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(42)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request: pytest.FixtureRequest, hf_checkpoint: Callable[..., Path]) -> Path:
    return hf_checkpoint(request.param)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    """transformers ``generate``, greedy, one prompt at a time, EOS disabled."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    outs = []
    for prompt in prompts(model.config.vocab_size):
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        outs.append(out[0, len(prompt) :].tolist())
        assert len(outs[-1]) == NEW_TOKENS
    return outs


def run_staggered(engine: Engine, ps: list[list[int]]) -> tuple[list[list[int]], list[set[str]]]:
    """Add two requests, then the long one and the last one while others decode.

    Returns each request's tokens and, per step, which requests sampled a token.
    """
    ids = [engine.add_request(ps[0], GREEDY), engine.add_request(ps[1], GREEDY)]
    tokens: dict[str, list[int]] = {}
    steps: list[set[str]] = []
    arrivals = {3: ps[2], 5: ps[3]}  # step number -> prompt added before that step
    while engine.has_unfinished() or arrivals:
        if len(steps) in arrivals:
            ids.append(engine.add_request(arrivals.pop(len(steps)), GREEDY))
        outs = engine.step()
        steps.append({o.request_id for o in outs if o.new_token_ids})
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason is FinishReason.LENGTH
    return [tokens[i] for i in ids], steps


def test_continuous_batching_matches_transformers(
    checkpoint: Path,
    reference: list[list[int]],
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    engine = Engine(
        str(checkpoint),
        block_size=8,
        num_blocks=128,
        max_num_batched_tokens=BUDGET,
        max_running_requests=4,
    )
    ps = prompts(engine.model_config.vocab_size)
    outs, steps = run_staggered(engine, ps)
    assert outs == reference
    # The long prompt arrived at step 3 and was prefilled in 5 chunks while the first
    # two requests kept decoding: prefills joined running decodes.
    first_long = next(i for i, s in enumerate(steps) if "req-2" in s)
    assert first_long >= 3 + 4
    assert all({"req-0", "req-1"} <= steps[i] for i in range(3, first_long))
    assert_no_leaks(engine)


def test_second_run_hits_the_prefix_cache_and_matches(
    checkpoint: Path,
    reference: list[list[int]],
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    engine = Engine(str(checkpoint), block_size=8, num_blocks=160, max_num_batched_tokens=BUDGET)
    ps = prompts(engine.model_config.vocab_size)
    assert engine.generate(ps, GREEDY) == reference
    engine.check_integrity()
    rid = engine.add_request(ps[2], GREEDY)
    hit = None
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            hit = out.num_cached_tokens
            tokens += out.new_token_ids
    assert hit == (len(ps[2]) - 1) // 8 * 8  # all full blocks but the last token's
    assert tokens == reference[2], rid
    assert_no_leaks(engine)


def test_pdd_generate_main_matches_transformers(
    checkpoint: Path, reference: list[list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = prompts(json.loads((checkpoint / "config.json").read_text())["vocab_size"])[1]
    argv = ["--model", str(checkpoint), "--prompt-ids", ",".join(map(str, prompt))]
    argv += ["--max-tokens", str(NEW_TOKENS), "--ignore-eos", "--json"]
    assert generate_cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {"token_ids": reference[1]}


def hand_over(
    tiny: LoadedModel, engine: Engine, params: SamplingParams, assert_no_leaks: Callable[..., None]
) -> RequestOutput:
    """Prefill a short prompt on another engine (P's part), attach it to ``engine`` as
    "handed" with its KV, and resume it after the first token; that token's output."""
    sender = Engine(tiny, block_size=4, num_blocks=64)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    pid = sender.add_request(prompt, SamplingParams(max_tokens=1), hold_kv=True)
    (first,) = sender.step()
    engine.attach_request(prompt, params, "handed")
    for chunk in sender.export_kv(pid, 0, len(prompt)):
        engine.import_kv("handed", chunk)
    sender.release(pid)
    assert_no_leaks(sender)
    engine.resume("handed", first.new_token_ids)
    return first


def test_handed_over_request_decodes_every_step_beside_a_chunked_prefill(
    tiny: LoadedModel, assert_no_leaks: Callable[[Engine], None]
) -> None:
    engine = Engine(tiny, block_size=4, num_blocks=256, max_num_batched_tokens=16)
    long_id = engine.add_request(list(range(3, 203)), SamplingParams(max_tokens=2))
    engine.step()  # the long prompt holds the running list's head: 12 more chunks to go
    hand_over(tiny, engine, SamplingParams(max_tokens=40, ignore_eos=True), assert_no_leaks)
    for _ in range(10):
        outs = {o.request_id: o for o in engine.step()}
        assert "handed" in outs and long_id not in outs  # decoding while the prefill is chunked
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)


def test_prefill_time_runs_from_the_first_prompt_step_to_the_first_token(
    tiny: LoadedModel, assert_no_leaks: Callable[[Engine], None]
) -> None:
    engine = Engine(tiny, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    ticks = iter(range(1000))
    engine.clock = lambda: float(next(ticks))  # add reads it once, a step twice (began, sampled)
    chunked = engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=3))  # 16+16+8
    outs = [o for _ in range(2) for o in engine.step()]  # ticks 1-4: chunks 1 and 2
    assert outs == []
    queued = engine.add_request([5, 6, 7], SamplingParams(max_tokens=1))  # 5; joins step 3
    step3 = {o.request_id: o for o in engine.step()}  # began at 6, sampled at 7
    assert step3[chunked].prefill_time_s == 6.0  # from its first chunk's step (1), not add
    assert step3[queued].prefill_time_s == 1.0  # a finishing output carries it too
    assert step3[queued].finished
    later = [o for _ in range(2) for o in engine.step()]
    assert [o.prefill_time_s for o in later] == [None, None]  # decode outputs have none
    assert_no_leaks(engine)


def test_queue_time_runs_from_add_to_the_first_step_and_rides_one_output_per_request(
    tiny: LoadedModel, assert_no_leaks: Callable[[Engine], None]
) -> None:
    """vLLM's ``request_queue_time_seconds``: add to first schedule, once per request,
    on the output with its first token (a later output, or a preemption, adds none)."""
    engine = Engine(tiny, block_size=4, num_blocks=64, max_num_batched_tokens=16,
                    max_running_requests=1)  # fmt: skip
    ticks = iter(range(1000))
    engine.clock = lambda: float(next(ticks))
    first = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))  # 0
    second = engine.add_request([8, 9], SamplingParams(max_tokens=2, ignore_eos=True))  # 1
    outs = []
    while engine.has_unfinished():
        outs += engine.step()  # first runs at 2; second waits for its seat: 3 steps
    carried = [(o.request_id, o.queue_time_s) for o in outs if o.queue_time_s is not None]
    assert carried == [(first, 2.0), (second, 7.0)]  # second: scheduled at tick 8
    assert all(o.queue_time_s is None or o.prefill_time_s is not None for o in outs)
    assert_no_leaks(engine)


def test_a_chunk_break_ends_one_chunk_there_and_the_others_are_whole(
    tiny: LoadedModel, drain: Callable[[Engine], list[RequestOutput]],
    assert_no_leaks: Callable[[Engine], None],
) -> None:  # fmt: skip
    """P-MD's prefill writes the KV MD lacks first after a short step; the chunks after
    it are whole, and the tokens are those of an uncut prefill."""
    prompt = list(range(3, 60))
    (reference,) = Engine(tiny, block_size=4, num_blocks=64).generate([prompt], GREEDY)
    engine = Engine(tiny, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    rid = engine.add_request(prompt, GREEDY, chunk_break=5)
    written = []
    for _ in range(3):
        engine.step()
        written.append(engine.computed_tokens(rid))
    assert written == [5, 21, 37]  # 5, then full 16-token steps
    out = [t for o in drain(engine) if o.request_id == rid for t in o.new_token_ids]
    assert out == reference
    assert_no_leaks(engine)


def test_a_chunk_break_names_a_position_so_a_cache_hit_past_it_leaves_no_cut(
    tiny: LoadedModel, drain: Callable[[Engine], list[RequestOutput]],
    assert_no_leaks: Callable[[Engine], None],
) -> None:  # fmt: skip
    """Where the prefix cache already supplies the break's position, the first step
    computes a whole budget from the hit; a break past the first chunk cuts a later one."""
    prompt = list(range(3, 60))
    engine = Engine(tiny, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    engine.generate([prompt[:24]], SamplingParams(max_tokens=1))  # caches 24 tokens
    rid = engine.add_request(prompt, GREEDY, chunk_break=10)
    later = engine.add_request(prompt[:10] + prompt[30:], GREEDY, chunk_break=20)
    engine.step()
    assert engine.computed_tokens(rid) == 24 + 16  # and the step's budget is spent
    engine.step()  # 16 more of rid's; then its last token beside later's first chunk:
    engine.step()
    assert engine.computed_tokens(rid) == len(prompt)
    assert engine.computed_tokens(later) == 20  # from its hit (8), 12 of 15, up to its break
    drain(engine)
    assert_no_leaks(engine)


def test_a_handed_over_request_reports_no_prefill_time(
    tiny: LoadedModel, assert_no_leaks: Callable[[Engine], None]
) -> None:
    engine = Engine(tiny, block_size=4, num_blocks=64)
    first = hand_over(tiny, engine, SamplingParams(max_tokens=4, ignore_eos=True), assert_no_leaks)
    assert first.prefill_time_s is not None and first.prefill_time_s >= 0  # the sender's
    outs = [o for _ in range(3) for o in engine.step()]
    assert len(outs) == 3 and all(o.prefill_time_s is None for o in outs)
    assert all(o.queue_time_s is None for o in outs)  # attached: it never queued here
    assert_no_leaks(engine)
