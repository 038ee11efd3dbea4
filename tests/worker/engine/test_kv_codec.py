"""The WAN KV codecs: round trips within each codec's bound, the exact wire size the
cost model counts, per-channel key scales, and a chunk coded otherwise than agreed refused.

Quality on real checkpoints (logits, greedy agreement) is ``test_kv_codec_quality``.
"""

from __future__ import annotations

import pytest
import torch

from pdd.common.cost_model import kv_bytes_per_token
from pdd.common.kv_codec import GROUP_TOKENS, KV_CODECS, chunk_wire_bytes
from pdd.worker.engine import Engine
from pdd.worker.engine.kv_codec import decode, encode, fp8_supported
from pdd.worker.engine.kv_transfer import CodecMismatchError, decode_chunk
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.loader import LoadedModel

pytestmark = pytest.mark.unit

LOSSY = [c for c in KV_CODECS if c != "none" and (c != "fp8" or fp8_supported())]
#: Worst error of a code relative to its group's largest magnitude: half a step for the
#: integer codes (a step is amax / qmax, raised by up to 2**-7 by the bfloat16 scale);
#: e4m3 keeps 3 mantissa bits, so its error is relative to the value (2**-4) plus
#: what underflows below its smallest subnormal (2**-9 of the scale, 448 * 2**-9 of amax).
STEP_BOUND = {"int8": 0.5 / 127 * 1.02, "int4": 0.5 / 7 * 1.02}


def kv(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """KV ``[L=3, 2, n, Hkv=2, D=16]`` with per-channel magnitudes as in real keys."""
    gen = torch.Generator().manual_seed(seed)
    channel_scale = torch.rand(1, 2, 1, 2, 16, generator=gen) * 4 + 0.1
    return (torch.randn(3, 2, n, 2, 16, generator=gen) * channel_scale).to(dtype)


def group_amax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each element's scale-group amax, for keys (per channel) and values (per head)."""
    n = x.shape[2]
    pad = -n % GROUP_TOKENS
    padded = torch.nn.functional.pad(x.float().abs(), (0, 0, 0, 0, 0, pad))
    groups = padded.view(3, 2, -1, GROUP_TOKENS, 2, 16)
    k = groups[:, 0].amax(dim=2, keepdim=True).expand_as(groups[:, 0])
    v = groups[:, 1].amax(dim=(2, 4), keepdim=True).expand_as(groups[:, 1])
    return k.reshape(3, -1, 2, 16)[:, :n], v.reshape(3, -1, 2, 16)[:, :n]


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
    k_amax, v_amax = group_amax(x)
    if codec == "fp8":
        bound_k = x[:, 0].float().abs() * 2**-4 + k_amax * 2**-9
        bound_v = x[:, 1].float().abs() * 2**-4 + v_amax * 2**-9
    else:
        bound_k, bound_v = k_amax * STEP_BOUND[codec], v_amax * STEP_BOUND[codec]
    # The decode rounds to ``dtype`` once more (bfloat16: up to 2**-9 of the value).
    slack = x.float().abs() * (2**-8 if dtype == torch.bfloat16 else 0.0)
    assert (err[:, 0] <= bound_k + slack[:, 0]).all()
    assert (err[:, 1] <= bound_v + slack[:, 1]).all()


@pytest.mark.parametrize("codec", LOSSY)
def test_a_loud_key_channel_does_not_coarsen_the_others(codec: str) -> None:
    """Per-channel key scales: one channel 1000x louder leaves the rest as precise as alone."""
    quiet = kv(64)
    loud = quiet.clone()
    loud[:, 0, :, :, 3] *= 1000
    err_quiet = decode(encode(quiet, codec), codec, quiet.shape, torch.float32, "cpu") - quiet  # type: ignore[arg-type]
    err_loud = decode(encode(loud, codec), codec, loud.shape, torch.float32, "cpu") - loud  # type: ignore[arg-type]
    others = [c for c in range(16) if c != 3]
    assert torch.equal(err_loud[:, 0, :, :, others], err_quiet[:, 0, :, :, others])


@pytest.mark.parametrize("codec", LOSSY)
def test_all_zero_groups_decode_to_zeros(codec: str) -> None:
    x = kv(80)
    x[:, :, :64] = 0  # the first group of keys and values
    y = decode(encode(x, codec), codec, x.shape, torch.float32, "cpu")  # type: ignore[arg-type]
    assert torch.isfinite(y).all()
    assert torch.equal(y[:, :, :64], x[:, :, :64])


def test_cost_model_counts_what_a_chunk_of_full_groups_takes() -> None:
    shape = (32, 8, 128, 2)  # Llama-3-8B, bfloat16
    raw = kv_bytes_per_token(*shape)
    for codec in ("fp8", "int8", "int4"):
        per_token = kv_bytes_per_token(*shape, codec=codec)  # type: ignore[arg-type]
        chunk = chunk_wire_bytes(codec, 32, 4 * GROUP_TOKENS, 8, 128, 2)  # type: ignore[arg-type]
        assert per_token * 4 * GROUP_TOKENS == chunk
    assert kv_bytes_per_token(*shape, codec="int8") / raw <= 0.52
    assert kv_bytes_per_token(*shape, codec="fp8") == kv_bytes_per_token(*shape, codec="int8")
    assert kv_bytes_per_token(*shape, codec="int4") / raw <= 0.28


PROMPT = [(i * 13 + 5) % 250 for i in range(100)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("codec", LOSSY)
def test_engine_imports_compressed_kv_in_its_dtype_and_continues(
    tiny: LoadedModel, codec: str, assert_no_leaks
) -> None:
    sender = Engine(tiny, block_size=16, num_blocks=32)
    rid = sender.add_request(PROMPT, greedy(1), hold_kv=True)
    (first,) = [t for out in _drain(sender) for t in out.new_token_ids]
    chunks = list(sender.export_kv(rid, 0, len(PROMPT), 48, codec))  # type: ignore[arg-type]
    assert {decode_chunk(c)[0].codec for c in chunks} == {codec}
    exact = sender.kv.read_tokens(sender._get(rid).block_table, 0, len(PROMPT)).clone()
    sender.release(rid)

    receiver = Engine(tiny, block_size=16, num_blocks=32)
    receiver.attach_request(PROMPT, greedy(8), "r")
    assert [receiver.import_kv("r", c, codec) for c in chunks] == [48, 96, 100]  # type: ignore[arg-type]
    got = receiver.kv.read_tokens(receiver._get("r").block_table, 0, len(PROMPT))
    assert got.dtype == exact.dtype
    assert (got - exact).abs().max() <= exact.abs().max() * STEP_BOUND["int4"]
    receiver.resume("r", [first])
    assert len([t for out in _drain(receiver) for t in out.new_token_ids]) == 7
    assert_no_leaks(receiver)


def test_a_chunk_coded_otherwise_than_agreed_is_refused_and_changes_nothing(
    tiny: LoadedModel,
) -> None:
    sender = Engine(tiny, block_size=16, num_blocks=32)
    rid = sender.add_request(PROMPT, greedy(1), hold_kv=True)
    _drain(sender)
    (chunk,) = sender.export_kv(rid, 0, len(PROMPT), 256, "int8")
    (plain,) = sender.export_kv(rid, 0, len(PROMPT), 256)
    receiver = Engine(tiny, block_size=16, num_blocks=32)
    receiver.attach_request(PROMPT, greedy(4), "r")
    with pytest.raises(CodecMismatchError, match="coded int8, the transfer agreed on none"):
        receiver.import_kv("r", chunk)
    with pytest.raises(CodecMismatchError, match="coded none, the transfer agreed on int4"):
        receiver.import_kv("r", plain, "int4")
    assert receiver._get("r").num_computed == 0
    assert receiver.import_kv("r", chunk, "int8") == len(PROMPT)


def _drain(engine: Engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs
