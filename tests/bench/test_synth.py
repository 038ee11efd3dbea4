from __future__ import annotations

import pytest

from pdd.bench.synth import Scaling, ScalingError, TokenSynthesizer, synthesize
from pdd.local.traces.base import Chain, Spawn, Trace, TraceRequest

pytestmark = pytest.mark.unit


def req(key: str, ids: tuple[int, ...], n_in: int, ns: str = "s", bs: int = 64) -> TraceRequest:
    return TraceRequest(key, ns, ids, n_in, 100, bs, think_s=50.0)


def test_equal_hash_ids_give_identical_prefixes_and_unique_tails() -> None:
    synth = TokenSynthesizer(Scaling(tokens_per_block=4))
    a = synth.prompt_ids(req("a", (1, 2, 3), 3 * 64 + 32))
    b = synth.prompt_ids(req("b", (1, 2, 3, 4), 4 * 64 + 32))
    c = synth.prompt_ids(req("c", (1, 9), 2 * 64))
    assert len(a) == 14 and len(b) == 18  # 4 per block, tail scaled too
    assert a[:12] == b[:12]  # three shared blocks
    assert a[12:14] != b[12:14]  # a's tail is its own, not block 4
    assert c[:4] == a[:4] and c[4:8] != a[4:8]
    other_ns = TokenSynthesizer(Scaling(tokens_per_block=4)).prompt_ids(req("a", (1,), 64, "t"))
    assert other_ns != a[:4]  # ids are scoped to their namespace


def test_fractional_tokens_per_block_keeps_prefix_structure() -> None:
    synth = TokenSynthesizer(Scaling(tokens_per_block=0.25))
    short = synth.prompt_ids(req("x", tuple(range(40)), 40 * 64))
    long = synth.prompt_ids(req("y", tuple(range(80)), 80 * 64))
    assert (len(short), len(long)) == (10, 20)
    assert long[:10] == short


def test_token_ids_stay_in_range() -> None:
    scaling = Scaling(tokens_per_block=16, token_low=100, token_high=110)
    ids = TokenSynthesizer(scaling).prompt_ids(req("z", (5, 6), 2 * 512, bs=512))
    assert all(100 <= i < 110 for i in ids)


def test_jobs_scale_output_time_and_flag_requests_too_long() -> None:
    scaling = Scaling(
        tokens_per_block=64, output_scale=0.5, max_output_tokens=40, time_scale=0.1,
        max_think_s=20.0, max_context_tokens=300,
    )  # fmt: skip
    child = Chain("kid", 0.0, (req("k", (7,), 64),))
    chain = Chain("s", 10.0, (req("a", (1,), 64), req("b", (1, 2, 3, 4, 5), 5 * 64)))
    chain = Chain(chain.name, chain.start_s, chain.requests, (Spawn(0, 30.0, child),))
    work = synthesize(Trace("t", 64, (chain,)), scaling)
    (c,) = work.chains
    assert c.start_s == pytest.approx(1.0)
    assert c.spawns[0].delay_s == pytest.approx(3.0)
    a, b = c.requests
    assert a.max_tokens == 40  # 100 * 0.5 clamped to 40
    assert a.think_s == pytest.approx(2.0)  # 50 s capped at 20 s, x0.1
    assert a.fits and not b.fits  # 320 prompt tokens + 40 > 300


def test_bad_scaling_is_rejected_with_the_field_named() -> None:
    with pytest.raises(ScalingError, match="tokens_per_block"):
        Scaling(tokens_per_block=0)
    with pytest.raises(ScalingError, match="min_output_tokens"):
        Scaling(tokens_per_block=1, min_output_tokens=10, max_output_tokens=5)
