"""The extend (recompute) pass: k handed-over token IDs computed in ONE forward pass.

After it, the KV must equal a fresh prefill of the whole sequence and the
continuation must equal an uninterrupted generation; several requests extend
in one batch, and an extend is never split by the prefill token budget.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdd.worker.engine import Engine
from pdd.worker.engine.kv_transfer import decode_chunk, payload_tensor
from pdd.worker.engine.request import (
    InvalidRequestStateError,
    PromptTooLongError,
    UnknownRequestError,
)
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.loader import LoadedModel

pytestmark = pytest.mark.unit

TOTAL = 40
CASES = [(7, 12), (30, 20), (16, 5)]  # (prompt length, handed-over tokens k)


def kv_of(engine: Engine, request_id: str, end: int) -> torch.Tensor:
    (chunk,) = list(engine.export_kv(request_id, 0, end, chunk_tokens=end))
    return payload_tensor(*decode_chunk(chunk), device="cpu")


def run_until_first_token(engine: Engine, ids: list[str]) -> dict[str, list[int]]:
    produced: dict[str, list[int]] = {i: [] for i in ids}
    while not all(produced.values()):
        for out in engine.step():
            produced[out.request_id] += out.new_token_ids
    return produced


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 31 + i * 7) % 250 for i in range(n)]


def params(seed: int | None = None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=TOTAL, ignore_eos=True)
    return SamplingParams(max_tokens=TOTAL, temperature=0.8, seed=seed, ignore_eos=True)


@pytest.mark.parametrize("seed", [None, 77], ids=["greedy", "seeded"])
def test_extend_several_requests_in_one_pass_equals_prefill_and_continues(
    tiny: LoadedModel,
    seed: int | None,
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    prompts = [prompt(n, salt) for salt, (n, _) in enumerate(CASES)]
    reference = Engine(tiny, block_size=4, num_blocks=256).generate(prompts, params(seed))
    engine = Engine(tiny, block_size=4, num_blocks=256, max_num_batched_tokens=8)
    ids = [engine.add_request(p, params(seed)) for p in prompts]
    produced = run_until_first_token(engine, ids)  # prefill, chunked by the small budget

    for rid, (_, k), ref in zip(ids, CASES, reference, strict=True):
        assert produced[rid] == ref[: len(produced[rid])]
        engine.extend(rid, ref[len(produced[rid]) : k])  # k tokens without KV now
    outs = engine.step()  # ONE pass for all three extends, each beyond the 8-token budget
    expected = {rid: [ref[k]] for rid, (_, k), ref in zip(ids, CASES, reference, strict=True)}
    assert {o.request_id: o.new_token_ids for o in outs} == expected

    fresh = Engine(tiny, block_size=8, num_blocks=256)
    for rid, p, (n, k), ref in zip(ids, prompts, CASES, reference, strict=True):
        whole = p + ref[:k]
        fid = fresh.add_request(whole, SamplingParams(max_tokens=1), hold_kv=True)
        while fresh.has_unfinished():
            fresh.step()
        torch.testing.assert_close(kv_of(engine, rid, n + k), kv_of(fresh, fid, n + k))
        fresh.release(fid)

    tokens = {rid: ref[: k + 1] for rid, (_, k), ref in zip(ids, CASES, reference, strict=True)}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[i] for i in ids] == reference
    assert_no_leaks(engine)
    assert_no_leaks(fresh)


def test_catch_up_handoff_holds_sampling_between_chunks(
    tiny: LoadedModel, assert_no_leaks: Callable[[Engine], None]
) -> None:
    p = prompt(21, 5)
    (reference,) = Engine(tiny, block_size=4, num_blocks=128).generate([p], params(9))
    engine = Engine(tiny, block_size=4, num_blocks=128)
    rid = engine.add_request(p, params(9))
    assert run_until_first_token(engine, [rid]) == {rid: reference[:1]}
    engine.extend(rid, reference[1:10], hold=True)
    assert engine.step() == []  # computed, nothing sampled
    engine.extend(rid, reference[10:16], hold=True)
    assert engine.step() == []
    assert not engine.has_unfinished()  # caught up and held: nothing to step until told
    engine.extend(rid, [], hold=False)  # caught up: sample from here on
    tokens = reference[:16]
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert tokens == reference
    assert_no_leaks(engine)


@pytest.mark.parametrize("attached", [True, False], ids=["after-import", "after-catch-up"])
def test_a_request_finished_elsewhere_is_computed_and_cached_without_sampling(
    tiny: LoadedModel, attached: bool, assert_no_leaks: Callable[[Engine], None]
) -> None:
    """MD's side of a request the relay ran to the end: the answer's KV is computed in one
    pass, nothing is sampled, and the next turn hits the whole conversation."""
    p = prompt(22, 3)
    (reference,) = Engine(tiny, block_size=4, num_blocks=128).generate([p], params())
    engine = Engine(tiny, block_size=4, num_blocks=128)
    if attached:  # the KV came from P; the relay had finished before MD asked for its IDs
        source = Engine(tiny, block_size=4, num_blocks=128)
        sid = source.add_request(p, SamplingParams(max_tokens=1), hold_kv=True)
        while source.has_unfinished():
            source.step()
        rid = "finished-elsewhere"
        hit = engine.attach_request(p, params(), rid)
        for chunk in source.export_kv(sid, hit, len(p)):
            engine.import_kv(rid, chunk)
        source.release(sid)
        engine.finished_elsewhere(rid, reference)
    else:  # a catch-up chunk was computed before the relay finished
        rid = engine.add_request(p, params())
        run_until_first_token(engine, [rid])
        engine.extend(rid, reference[1:10], hold=True)
        assert engine.step() == []
        engine.finished_elsewhere(rid, reference[10:])
    outs = engine.step()
    assert [(o.request_id, o.new_token_ids, o.finished) for o in outs] == [(rid, [], True)]
    assert not engine.has_unfinished()

    next_turn = p + reference + [5, 6, 7]
    nid = engine.add_request(next_turn, params())
    (first,) = engine.step()  # the uncached tail fits one step's budget
    engine.abort(nid)
    whole = len(p) + len(reference)
    assert first.num_cached_tokens == whole // 4 * 4  # not just the prompt's 20
    (fresh,) = Engine(tiny, block_size=4, num_blocks=128).generate([next_turn], params())
    assert first.new_token_ids == fresh[:1]  # the cached answer's KV is right
    assert_no_leaks(engine)


def test_extend_errors_leave_the_engine_serving(
    tiny: LoadedModel, assert_no_leaks: Callable[[Engine], None]
) -> None:
    engine = Engine(tiny, block_size=4, num_blocks=64, max_model_len=64)
    with pytest.raises(UnknownRequestError, match="nope"):
        engine.extend("nope", [1, 2])
    rid = engine.add_request(prompt(10, 1), params())
    engine.step()
    with pytest.raises(PromptTooLongError, match="context window is 64"):
        engine.extend(rid, [3] * 60)
    with pytest.raises(InvalidRequestStateError, match="resume"):
        engine.resume(rid, [1])
    engine.abort(rid)
    assert (
        engine.generate([prompt(10, 1)], params())[0]
        == Engine(tiny).generate([prompt(10, 1)], params())[0]
    )
    assert_no_leaks(engine)
