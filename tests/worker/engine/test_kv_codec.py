"""The WAN KV codecs: round trips within each codec's bound, the exact wire size the
cost model counts, per-vector centred scales, and a chunk coded otherwise than agreed refused.

Quality on real checkpoints (logits, greedy agreement) is ``test_kv_codec_quality``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdd.common.cost_model import kv_bytes_per_token
from pdd.common.kv_codec import KV_CODECS, chunk_wire_bytes, handshake_name
from pdd.worker.engine import Engine
from pdd.worker.engine.kv_codec import decode, encode, fp8_supported
from pdd.worker.engine.kv_transfer import CodecMismatchError, decode_chunk
from pdd.worker.engine.request import RequestOutput
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.loader import LoadedModel

pytestmark = pytest.mark.unit

LOSSY = [c for c in KV_CODECS if c != "none" and (c != "fp8" or fp8_supported())]
#: Worst error of a code relative to its vector's half range: half a step for the
#: integer codes (a step is half range / qmax, raised by up to 2**-7 by the bfloat16
#: scale); e4m3 keeps 3 mantissa bits, so its error is relative to the distance from
#: the centre (2**-4) plus what underflows below its smallest subnormal (2**-9 of the
#: scale, 448 * 2**-9 of the half range).
STEP_BOUND = {"int8": 0.5 / 127 * 1.02, "int4": 0.5 / 7 * 1.02}


def kv(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """KV ``[L=3, 2, n, Hkv=2, D=16]`` with per-channel magnitudes and offsets, as in real
    keys (a biased K projection shifts every token's key by the same vector)."""
    gen = torch.Generator().manual_seed(seed)
    channel_scale = torch.rand(1, 2, 1, 2, 16, generator=gen) * 4 + 0.1
    offset = torch.randn(1, 2, 1, 2, 16, generator=gen) * 3
    return (torch.randn(3, 2, n, 2, 16, generator=gen) * channel_scale + offset).to(dtype)


def half_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each element's distance bound from its vector's centre, and the vector's half range
    widened by the centre's bfloat16 rounding (2**-9 of it, bounded by 2**-8)."""
    x = x.float()
    high, low = x.amax(dim=-1, keepdim=True), x.amin(dim=-1, keepdim=True)
    mid = (high + low) / 2
    slack = mid.abs() * 2**-8
    return (x - mid).abs() + slack, ((high - low) / 2 + slack).expand_as(x)


@pytest.mark.parametrize("n", [1, 63, 64, 100, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("codec", KV_CODECS)
def test_round_trip_within_the_codecs_bound_and_exact_size(
    codec: str, dtype: torch.dtype, n: int
) -> None:
    if codec == "fp8" and not fp8_supported():
        pytest.skip("this torch has no float8_e4m3fn")
    x = kv(n, dtype)
    payload = encode(x, codec)  # type: ignore[arg-type]
    assert len(payload) == chunk_wire_bytes(codec, 3, n, 2, 16, x.element_size())  # type: ignore[arg-type]
    y = decode(payload, codec, tuple(x.shape), dtype, "cpu")  # type: ignore[arg-type]
    assert y.dtype == dtype and y.shape == x.shape
    if codec == "none":
        assert torch.equal(y, x)
        return
    err = (y.float() - x.float()).abs()
    dist, half = half_range(x)
    fp8 = codec == "fp8"
    bound = dist * 2**-4 + half * 2**-9 if fp8 else half * STEP_BOUND.get(codec, 0.0)
    # The decode rounds to ``dtype`` once more (bfloat16: up to 2**-9 of the value).
    slack = x.float().abs() * (2**-8 if dtype == torch.bfloat16 else 0.0)
    assert (err <= bound + slack).all()


@pytest.mark.parametrize("codec", LOSSY)
def test_a_loud_token_does_not_coarsen_its_neighbours(codec: str) -> None:
    """Scales are per vector: one token 1000x louder leaves every other as precise as before."""
    quiet = kv(64)
    loud = quiet.clone()
    loud[:, :, 5] *= 1000
    err_quiet = decode(encode(quiet, codec), codec, quiet.shape, torch.float32, "cpu") - quiet  # type: ignore[arg-type]
    err_loud = decode(encode(loud, codec), codec, loud.shape, torch.float32, "cpu") - loud  # type: ignore[arg-type]
    others = [t for t in range(64) if t != 5]
    assert torch.equal(err_loud[:, :, others], err_quiet[:, :, others])


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_an_offset_costs_only_the_centres_rounding(codec: str) -> None:
    """The centre takes a vector's offset out: shifted by 10 (far beyond its spread of
    about 1), a vector is coded almost as finely as unshifted, where a scale that had
    to reach zero would take steps ten times coarser."""
    x = torch.randn(3, 2, 64, 2, 16, generator=torch.Generator().manual_seed(1))
    err = decode(encode(x, codec), codec, x.shape, torch.float32, "cpu") - x  # type: ignore[arg-type]
    shifted = x + 10
    err_shifted = decode(encode(shifted, codec), codec, x.shape, torch.float32, "cpu") - shifted  # type: ignore[arg-type]
    assert err_shifted.abs().mean() <= 1.2 * err.abs().mean()


@pytest.mark.parametrize("codec", LOSSY)
def test_all_zero_vectors_decode_to_zeros(codec: str) -> None:
    x = kv(80)
    x[:, :, :64] = 0  # the first 64 tokens' keys and values
    y = decode(encode(x, codec), codec, x.shape, torch.float32, "cpu")  # type: ignore[arg-type]
    assert torch.isfinite(y).all()
    assert torch.equal(y[:, :, :64], x[:, :, :64])


@pytest.mark.parametrize("n", [1, 7, 64, 255])
def test_cost_model_counts_what_a_chunk_of_any_length_takes(n: int) -> None:
    shape = (32, 8, 128, 2)  # Llama-3-8B, bfloat16
    for codec in ("fp8", "int8", "int4"):
        per_token = kv_bytes_per_token(*shape, codec=codec)  # type: ignore[arg-type]
        assert per_token * n == chunk_wire_bytes(codec, 32, n, 8, 128, 2)  # type: ignore[arg-type]


def test_int8_and_int4_meet_their_byte_bars_at_head_dim_128() -> None:
    shape = (32, 8, 128, 2)  # Llama-3-8B, bfloat16
    raw = kv_bytes_per_token(*shape)
    assert kv_bytes_per_token(*shape, codec="int8") / raw <= 0.52
    assert kv_bytes_per_token(*shape, codec="fp8") == kv_bytes_per_token(*shape, codec="int8")
    assert kv_bytes_per_token(*shape, codec="int4") / raw <= 0.28


def test_the_handshake_names_the_coded_layout() -> None:
    """A lossy codec's handshake name carries the layout version (a P and an MD of builds
    that code int8 differently must not agree on "int8"); exact KV stays "none"."""
    assert handshake_name("none") == "none"
    assert {handshake_name(c) for c in ("fp8", "int8", "int4")}.isdisjoint(KV_CODECS)


PROMPT = [(i * 13 + 5) % 250 for i in range(100)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("codec", LOSSY)
def test_engine_imports_compressed_kv_in_its_dtype_and_continues(
    tiny: LoadedModel, codec: str, drain: Callable[[Engine], list[RequestOutput]], assert_no_leaks
) -> None:
    sender = Engine(tiny, block_size=16, num_blocks=32)
    rid = sender.add_request(PROMPT, greedy(1), hold_kv=True)
    (first,) = [t for out in drain(sender) for t in out.new_token_ids]
    chunks = list(sender.export_kv(rid, 0, len(PROMPT), 48, codec))  # type: ignore[arg-type]
    assert {decode_chunk(c)[0].codec for c in chunks} == {codec}
    exact = sender.kv.read_tokens(sender.requests.get(rid).block_table, 0, len(PROMPT)).clone()
    sender.release(rid)

    receiver = Engine(tiny, block_size=16, num_blocks=32)
    receiver.attach_request(PROMPT, greedy(8), "r")
    assert [receiver.import_kv("r", c, codec) for c in chunks] == [48, 96, 100]  # type: ignore[arg-type]
    got = receiver.kv.read_tokens(receiver.requests.get("r").block_table, 0, len(PROMPT))
    assert got.dtype == exact.dtype
    assert (got - exact).abs().max() <= exact.abs().max() * STEP_BOUND["int4"]
    receiver.resume("r", [first])
    assert len([t for out in drain(receiver) for t in out.new_token_ids]) == 7
    assert_no_leaks(receiver)


def test_a_chunk_coded_otherwise_than_agreed_is_refused_and_changes_nothing(
    tiny: LoadedModel, drain: Callable[[Engine], list[RequestOutput]]
) -> None:
    sender = Engine(tiny, block_size=16, num_blocks=32)
    rid = sender.add_request(PROMPT, greedy(1), hold_kv=True)
    drain(sender)
    (chunk,) = sender.export_kv(rid, 0, len(PROMPT), 256, "int8")
    (plain,) = sender.export_kv(rid, 0, len(PROMPT), 256)
    receiver = Engine(tiny, block_size=16, num_blocks=32)
    receiver.attach_request(PROMPT, greedy(4), "r")
    with pytest.raises(CodecMismatchError, match="coded int8, the transfer agreed on none"):
        receiver.import_kv("r", chunk)
    with pytest.raises(CodecMismatchError, match="coded none, the transfer agreed on int4"):
        receiver.import_kv("r", plain, "int4")
    assert receiver.requests.get("r").num_computed == 0
    assert receiver.import_kv("r", chunk, "int8") == len(PROMPT)
