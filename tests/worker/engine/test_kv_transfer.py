"""KV export -> import -> continue on a second engine, and every way a chunk is refused.

The receiver continues exactly where the sender stopped (greedy and seeded), also
when it already holds a prefix in its radix cache and attaches the imported
range after it. A damaged or foreign chunk raises a typed error, changes
nothing, and the handoff then completes with the good chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdd.worker.engine import Engine
from pdd.worker.engine.kv_transfer import (
    ChecksumError,
    DtypeMismatchError,
    FingerprintMismatchError,
    KVGapError,
    KVRangeError,
    LayoutMismatchError,
    MalformedChunkError,
    TokenMismatchError,
    decode_chunk,
    encode_chunk,
    payload_tensor,
)
from pdd.worker.engine.request import InvalidRequestStateError, RequestOutput
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.loader import LoadedModel, load_model

pytestmark = pytest.mark.unit

MAX_TOKENS = 30
PROMPT = [(i * 13 + 5) % 250 for i in range(45)]


def params(seed: int | None) -> SamplingParams:
    temperature = 0.0 if seed is None else 0.9
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, ignore_eos=True
    )


Drain = Callable[[Engine], list[RequestOutput]]
Prefill = Callable[[Engine, list[int], SamplingParams], tuple[str, int]]
Finish = Callable[[Engine, str], list[int]]


@pytest.fixture
def prefill(drain: Drain) -> Prefill:
    """``prefill(sender, prompt, sp)``: run the prefill role, one token with the KV kept
    for export; the request's id and that token."""

    def run(sender: Engine, prompt: list[int], sp: SamplingParams) -> tuple[str, int]:
        rid = sender.add_request(prompt, sp.with_changes(max_tokens=1), hold_kv=True)
        (first,) = [t for out in drain(sender) for t in out.new_token_ids]
        return rid, first

    return run


@pytest.fixture
def finish(drain: Drain) -> Finish:
    """``finish(receiver, rid)``: step the receiver until idle; that request's tokens."""

    def run(receiver: Engine, rid: str) -> list[int]:
        return [t for out in drain(receiver) if out.request_id == rid for t in out.new_token_ids]

    return run


@pytest.mark.parametrize("seed", [None, 2024], ids=["greedy", "seeded"])
def test_export_import_continue_equals_one_engine(
    tiny: LoadedModel,
    prefill: Prefill,
    finish: Finish,
    seed: int | None,
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    (reference,) = Engine(tiny, block_size=4, num_blocks=128).generate([PROMPT], params(seed))
    sender = Engine(tiny, block_size=4, num_blocks=64)
    rid, first = prefill(sender, PROMPT, params(seed))
    chunks = list(sender.export_kv(rid, 0, len(PROMPT), chunk_tokens=16))
    assert len(chunks) == 3
    sender.release(rid)

    receiver = Engine(tiny, block_size=8, num_blocks=64)  # another block size: layout is per token
    assert receiver.attach_request(PROMPT, params(seed), "r1") == 0
    assert [receiver.import_kv("r1", c) for c in chunks] == [16, 32, 45]
    receiver.resume("r1", [first])
    assert [first, *finish(receiver, "r1")] == reference
    assert_no_leaks(sender)
    assert_no_leaks(receiver)


@pytest.mark.parametrize("export_from", ["hit", "zero"])
def test_receiver_attaches_import_after_its_cached_prefix(
    tiny: LoadedModel,
    prefill: Prefill,
    finish: Finish,
    export_from: str,
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    (reference,) = Engine(tiny, block_size=4, num_blocks=128).generate([PROMPT], params(None))
    receiver = Engine(tiny, block_size=8, num_blocks=64)
    earlier_turn = [*PROMPT[:27], 1, 2, 3]
    receiver.generate([earlier_turn], SamplingParams(max_tokens=4))  # caches 3 full blocks
    hit = receiver.attach_request(PROMPT, params(None), "r1")
    assert hit == 24

    sender = Engine(tiny, block_size=4, num_blocks=64)
    rid, first = prefill(sender, PROMPT, params(None))
    start = hit if export_from == "hit" else 0  # an overlapping chunk skips what is held
    for chunk in sender.export_kv(rid, start, len(PROMPT), chunk_tokens=10):
        receiver.import_kv("r1", chunk)
    sender.release(rid)
    receiver.resume("r1", [first])
    assert [first, *finish(receiver, "r1")] == reference
    assert_no_leaks(receiver)


def test_attach_without_the_cache_takes_all_kv_and_leaves_the_cache_alone(
    tiny: LoadedModel,
    prefill: Prefill,
    finish: Finish,
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    """The naive pipeline: MD holds the prompt but must import all of it, caching nothing."""
    (reference,) = Engine(tiny, block_size=4, num_blocks=128).generate([PROMPT], params(None))
    receiver = Engine(tiny, block_size=8, num_blocks=64)
    receiver.generate([[*PROMPT, 1]], SamplingParams(max_tokens=2))  # caches the whole prompt
    receiver.drain_cache_events()
    cached = receiver.stats.num_cached_blocks
    assert receiver.attach_request(PROMPT, params(None), "r1", use_cache=False) == 0
    assert receiver.stats.num_cached_blocks == cached  # nothing evicted for it

    sender = Engine(tiny, block_size=4, num_blocks=64)
    rid, first = prefill(sender, PROMPT, params(None))
    for chunk in sender.export_kv(rid, 0, len(PROMPT), chunk_tokens=16):
        receiver.import_kv("r1", chunk)
    sender.release(rid)
    receiver.resume("r1", [first])
    assert [first, *finish(receiver, "r1")] == reference
    assert receiver.drain_cache_events() == []  # its blocks went back to the pool, not the cache
    assert receiver.stats.num_cached_blocks == cached
    assert receiver.attach_request(PROMPT, params(None), "r2") == 40  # the old entry still hits
    receiver.abort("r2")
    assert_no_leaks(sender)
    assert_no_leaks(receiver)


def test_refused_chunks_change_nothing_and_the_handoff_completes(
    tiny: LoadedModel,
    prefill: Prefill,
    drain: Drain,
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    (reference,) = Engine(tiny, block_size=4, num_blocks=128).generate([PROMPT], params(None))
    sender = Engine(tiny, block_size=4, num_blocks=64)
    rid, first = prefill(sender, PROMPT, params(None))
    good = list(sender.export_kv(rid, 0, len(PROMPT), chunk_tokens=20))
    receiver = Engine(tiny, block_size=4, num_blocks=64)
    receiver.attach_request(PROMPT, params(None), "r1")

    corrupt = bytearray(good[0])
    corrupt[-5] ^= 0xFF
    data = payload_tensor(*decode_chunk(good[0]), device="cpu")
    refused = {
        ChecksumError: bytes(corrupt),
        MalformedChunkError: b"GET / HTTP/1.1\r\n",
        FingerprintMismatchError: encode_chunk(data, 0, "0123456789abcdef", PROMPT[:20]),
        DtypeMismatchError: encode_chunk(
            data.to(torch.bfloat16), 0, sender.fingerprint, PROMPT[:20]
        ),
        LayoutMismatchError: encode_chunk(data[:2], 0, sender.fingerprint, PROMPT[:20]),
        TokenMismatchError: encode_chunk(data, 0, sender.fingerprint, [7, *PROMPT[1:20]]),
        KVGapError: good[1],  # a gap: [20, 40) before [0, 20)
    }
    for error, chunk in refused.items():
        with pytest.raises(error):
            receiver.import_kv("r1", chunk)
        receiver.check_integrity()
    with pytest.raises(KVRangeError, match="holds KV for"):
        list(sender.export_kv(rid, 0, len(PROMPT) + 1))

    # The engine kept serving throughout: an unrelated request runs meanwhile.
    other = receiver.add_request([1, 2, 3], SamplingParams(max_tokens=5))
    assert [receiver.import_kv("r1", c) for c in good] == [20, 40, 45]
    receiver.resume("r1", [first])
    outs = drain(receiver)
    assert [first, *[t for o in outs if o.request_id == "r1" for t in o.new_token_ids]] == reference
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == other) == 5
    sender.release(rid)
    assert_no_leaks(sender)
    assert_no_leaks(receiver)


def test_bf16_engines_exchange_bf16_kv(
    tiny: LoadedModel,
    prefill: Prefill,
    finish: Finish,
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    bf16 = load_model("tiny", dtype="bfloat16")
    (reference,) = Engine(bf16, block_size=4, num_blocks=128).generate([PROMPT], params(None))
    sender = Engine(bf16, block_size=4, num_blocks=64)
    rid, first = prefill(sender, PROMPT, params(None))
    chunks = list(sender.export_kv(rid, 0, len(PROMPT), chunk_tokens=64))
    fp32 = Engine(tiny, block_size=4, num_blocks=64)
    fp32.attach_request(PROMPT, params(None), "r1")
    with pytest.raises(DtypeMismatchError, match="same --dtype"):
        fp32.import_kv("r1", chunks[0])
    fp32.abort("r1")
    receiver = Engine(bf16, block_size=4, num_blocks=64)
    receiver.attach_request(PROMPT, params(None), "r1")
    receiver.import_kv("r1", chunks[0])
    receiver.resume("r1", [first])
    assert [first, *finish(receiver, "r1")] == reference
    sender.release(rid)
    for engine in (sender, fp32, receiver):
        assert_no_leaks(engine)


def test_export_of_a_released_request_is_refused(
    tiny: LoadedModel,
    prefill: Prefill,
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    sender = Engine(tiny, block_size=4, num_blocks=64)
    rid, _ = prefill(sender, PROMPT, params(None))
    stream = sender.export_kv(rid, 0, len(PROMPT), chunk_tokens=8)
    next(stream)
    sender.release(rid)
    with pytest.raises(InvalidRequestStateError, match="lost its KV"):
        next(stream)
    assert_no_leaks(sender)
