"""Bad input and a full KV pool: clear typed errors, and the engine keeps serving.

Over-long prompts and requests that could never fit are refused at add_request;
requests that together overflow the pool queue or get preempted and still finish
with the same tokens as on a roomy engine; loader failures surface from Engine().
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from pdd.common.tokenizer import ByteTokenizer
from pdd.worker.engine import Engine, EngineConfigError
from pdd.worker.engine.request import (
    FinishReason,
    NoFreeBlocksError,
    PromptTooLongError,
    RequestError,
    RequestOutput,
    RequestTooLargeError,
    UnknownRequestError,
)
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedArchitectureError,
)
from pdd.worker.model.loader import LoadedModel

pytestmark = pytest.mark.unit


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(r * 17 + i * 5) % 250 for i in range(length + 3 * r)] for r in range(n)]


def test_bad_requests_are_refused_and_the_engine_keeps_serving(
    tiny: LoadedModel,
    drain: Callable[[Engine], list[RequestOutput]],
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    engine = Engine(tiny, block_size=4, num_blocks=16, max_model_len=100)
    running = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    refusals: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (PromptTooLongError, "context window is 100", lambda: engine.add_request([5] * 100)),
        (RequestTooLargeError, "16 blocks", lambda: engine.add_request([5] * 60)),
        (RequestError, "empty", lambda: engine.add_request([])),
        (RequestError, r"outside the vocabulary \[0, 259\)", lambda: engine.add_request([1, 300])),
        (RequestError, "already in use", lambda: engine.add_request([1], None, running)),
        (UnknownRequestError, "no live request 'x'", lambda: engine.abort("x")),
    ]
    for error, message, call in refusals:
        with pytest.raises(error, match=message):
            call()
        engine.check_integrity()
    tokens = [t for out in drain(engine) for t in out.new_token_ids]
    assert len(tokens) == 7  # the running request finished normally
    assert_no_leaks(engine)


def test_requests_overflowing_the_pool_queue_or_get_preempted_and_finish_correctly(
    tiny: LoadedModel,
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    batch = prompts(6, 20)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = Engine(tiny, block_size=4, num_blocks=256).generate(batch, params)
    # Each request needs 11-15 blocks at its end; 24 blocks hold fewer than two at once.
    tight = Engine(tiny, block_size=4, num_blocks=24, max_num_batched_tokens=32)
    assert tight.generate(batch, params) == reference
    assert tight.stats.num_preemptions > 0
    assert_no_leaks(tight)


def test_random_arrivals_and_aborts_on_a_tiny_pool_keep_every_invariant(
    tiny: LoadedModel,
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    rng = random.Random(7)
    shared = [rng.randrange(250) for _ in range(12)]  # common prefix: cache hits and sharing
    jobs = []
    for i in range(14):
        body = [rng.randrange(250) for _ in range(rng.randint(1, 30))]
        sp = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True)
        if i % 3 == 0:
            sp = sp.with_changes(temperature=0.8, seed=i)
        jobs.append((shared + body if i % 2 else body, sp))
    reference = Engine(tiny, block_size=4, num_blocks=512).generate(
        [p for p, _ in jobs], [sp for _, sp in jobs]
    )
    engine = Engine(
        tiny, block_size=4, num_blocks=20, max_num_batched_tokens=16, max_running_requests=5
    )
    tokens: dict[str, list[int]] = {}
    live: list[str] = []
    aborted: set[str] = set()
    queue = list(enumerate(jobs))
    while queue or engine.has_unfinished():
        if queue and rng.random() < 0.5:
            i, (p, sp) = queue.pop(0)
            live.append(engine.add_request(p, sp, f"job-{i}"))
        if live and rng.random() < 0.05:
            aborted.add(live[0])
            engine.abort(live.pop(0))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                live.remove(out.request_id)
        engine.check_integrity()
    for i, ref in enumerate(reference):
        got = tokens.get(f"job-{i}", [])
        assert got == (ref[: len(got)] if f"job-{i}" in aborted else ref), i
    assert aborted
    assert engine.stats.num_preemptions > 0
    assert_no_leaks(engine)


def test_attach_without_room_is_refused_with_a_retry_hint(
    tiny: LoadedModel, assert_no_leaks: Callable[[Engine], None]
) -> None:
    engine = Engine(tiny, block_size=4, num_blocks=9)
    params = SamplingParams(max_tokens=4)
    engine.attach_request(list(range(20)), params, "a")  # 5 blocks, not preemptible
    with pytest.raises(NoFreeBlocksError, match="retry later"):
        engine.attach_request(list(range(30, 50)), params, "b")
    engine.check_integrity()
    with pytest.raises(NoFreeBlocksError, match="release or abort"):
        engine.generate([list(range(60, 80))], params)  # would wait forever: refused
    engine.abort("req-0")
    engine.abort("a")
    assert engine.attach_request(list(range(30, 50)), params, "b") == 0
    engine.abort("b")
    assert_no_leaks(engine)


def test_abort_mid_generation_frees_everything(
    tiny: LoadedModel, assert_no_leaks: Callable[[Engine], None]
) -> None:
    engine = Engine(tiny, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    ids = [engine.add_request(p, SamplingParams(max_tokens=50)) for p in prompts(3, 20)]
    for _ in range(4):
        engine.step()
    engine.abort(ids[1])  # running
    engine.abort(ids[2])  # maybe still prefilling
    while engine.has_unfinished():
        engine.step()
    assert_no_leaks(engine)


def test_stop_on_eos_stop_ids_and_max_tokens(
    tiny: LoadedModel,
    drain: Callable[[Engine], list[RequestOutput]],
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    prompt = [10, 11, 12]
    (free_run,) = Engine(tiny).generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    stop_at = free_run[4]
    first = free_run.index(stop_at)
    with_eos = dataclasses.replace(tiny, tokenizer=ByteTokenizer(eos_id=stop_at))
    engine = Engine(with_eos, block_size=4, num_blocks=32)
    cases = {
        "eos": SamplingParams(max_tokens=12),
        "stop": SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,)),
        "ignored": SamplingParams(max_tokens=12, ignore_eos=True),
    }
    for name, params in cases.items():
        rid = engine.add_request(prompt, params, name)
        outs = [o for o in drain(engine) if o.request_id == rid]
        tokens = [t for o in outs for t in o.new_token_ids]
        expected, reason = (free_run, FinishReason.LENGTH)
        if name != "ignored":
            expected, reason = (free_run[: first + 1], FinishReason.STOP)
        assert (tokens, outs[-1].finish_reason) == (expected, reason), name
    assert_no_leaks(engine)


def test_loader_errors_surface_through_engine_construction(
    hf_checkpoint: Callable[..., Path],
) -> None:
    with pytest.raises(CheckpointNotFoundError, match="neither 'tiny', an existing checkpoint"):
        Engine("/no/such/model")
    ckpt = hf_checkpoint("llama")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        Engine(str(ckpt))
    (ckpt / "config.json").write_text(json.dumps(config))
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError):
        Engine(str(ckpt))


def test_bad_engine_options_are_refused() -> None:
    with pytest.raises(EngineConfigError, match="block_size"):
        Engine("tiny", block_size=0)
