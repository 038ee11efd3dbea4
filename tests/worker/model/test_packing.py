"""oneDNN-prepacked projections (fp32, bf16 on the CPU, bf16 widened to fp32 where the CPU
has no native bf16): same numbers, packed where it pays."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import PagedKVCache
from pdd.worker.model.layers import Linear, pack_dtype
from pdd.worker.model.loader import load_model

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(
    pack_dtype(CPU, torch.bfloat16) != torch.bfloat16, reason="oneDNN without bf16 on this CPU"
)


def bf16_layer(in_features: int, out_features: int, rows: int) -> tuple[Linear, torch.Tensor]:
    """A bf16 layer with a bias and ``rows`` bf16 inputs (seeded)."""
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=True).to(torch.bfloat16)
    return layer, torch.randn(rows, in_features, dtype=torch.bfloat16)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_is_bitwise_f_linear(rows: int) -> None:
    layer, x = bf16_layer(96, 160, rows)
    with torch.inference_mode():
        plain = layer(x)
        layer.pack(torch.bfloat16)
        assert torch.equal(layer(x), plain)
        assert torch.equal(plain, F.linear(x, layer.weight, layer.bias))


@needs_bf16
def test_bf16_cpu_model_is_packed_and_logits_unchanged() -> None:
    loaded = load_model("tiny", dtype="bfloat16")
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    assert all(m.packed.compute_dtype == torch.bfloat16 for m in linears)  # native: not widened
    tied = loaded.model.lm_head is None  # a tied head packs its own copy of the embedding
    assert (loaded.model._packed_head is not None) == tied
    hidden = torch.randn(3, loaded.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        packed = linears[0](hidden)
        linears[0].packed = None
        assert torch.equal(packed, linears[0](hidden))


needs_onednn = pytest.mark.skipif(
    pack_dtype(CPU, torch.float32) is None, reason="torch built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_fp32_linear_matches_f_linear(rows: int) -> None:
    """fp32 packed and plain differ only by the order of their fp32 sums."""
    torch.manual_seed(0)
    layer = Linear(1024, 320, bias=True)
    x = torch.randn(rows, 1024)
    with torch.inference_mode():
        plain = layer(x)
        layer.pack(torch.float32)
        torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_fp32_cpu_model_is_packed_with_the_same_greedy_tokens() -> None:
    loaded = load_model("tiny", dtype="float32")
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    assert (model._packed_head is not None) == (model.lm_head is None)
    ids = list(range(3, 60))
    kv = PagedKVCache(loaded.kv_layout(16), 8, "cpu")
    batch = ForwardBatch.build([SeqInput(ids, 0, list(range(4)), all_logits=True)], 16, "cpu")
    packed = model(batch, kv)
    for m in linears:
        m.packed = None
    model._packed_head = None
    plain = model(batch, kv)
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_non_cpu_and_other_dtypes_are_not_packed() -> None:
    assert pack_dtype(torch.device("cuda"), torch.bfloat16) is None
    assert pack_dtype(torch.device("cuda"), torch.float32) is None
    assert pack_dtype(CPU, torch.float16) is None


@needs_onednn
@pytest.mark.parametrize("native", [True, False])
def test_bf16_packs_widened_to_fp32_only_without_native_bf16(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    assert pack_dtype(CPU, torch.bfloat16) == (torch.bfloat16 if native else torch.float32)
    assert pack_dtype(CPU, torch.float32) == torch.float32


@needs_onednn
@pytest.mark.parametrize("rows", [2, 7, 64])
def test_widened_bf16_linear_is_f_linear_up_to_summation_order(rows: int) -> None:
    """A bf16 layer packed as fp32 takes and returns bf16; both it and F.linear sum in fp32
    and round once, so they differ by at most a bf16 rounding step (2**-8 relative)."""
    layer, x = bf16_layer(1024, 160, rows)
    with torch.inference_mode():
        plain = layer(x)
        layer.pack(torch.float32)
        widened = layer(x)
    assert widened.dtype == torch.bfloat16
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert (widened.double() - exact).abs().max() <= (exact.abs() * 2**-8).max()
    torch.testing.assert_close(widened, plain, rtol=2**-7, atol=2**-7)


@needs_onednn
def test_widened_bf16_linear_runs_one_row_from_the_plain_weight() -> None:
    """One row reads the bf16 weight (half the bytes): bitwise F.linear's result."""
    layer, x = bf16_layer(256, 96, 1)
    with torch.inference_mode():
        layer.pack(torch.float32)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_bf16_model_packed_widened_keeps_its_greedy_tokens() -> None:
    """The whole model, bf16 weights and KV, projections packed as fp32 (what an AVX2-only
    CPU runs): logits within bf16 rounding of the plain model's, the same greedy tokens."""
    loaded = load_model("tiny", dtype="bfloat16")
    model = loaded.model
    for m in model.modules():
        if isinstance(m, Linear):
            m.packed = None
    model._packed_head = None
    ids = list(range(3, 60))
    kv = PagedKVCache(loaded.kv_layout(16), 8, "cpu")
    batch = ForwardBatch.build([SeqInput(ids, 0, list(range(4)), all_logits=True)], 16, "cpu")
    plain = model(batch, kv)
    model.pack_weights(torch.float32)
    assert all(
        m.packed is not None and m.packed.compute_dtype == torch.float32
        for m in model.modules()
        if isinstance(m, Linear)
    )
    widened = model(batch, kv)
    torch.testing.assert_close(widened, plain, rtol=0.05, atol=0.05)
    assert torch.equal(widened.argmax(-1), plain.argmax(-1))


@needs_bf16
def test_tied_head_packs_the_embedding_with_the_same_logits(hf_checkpoint) -> None:
    loaded = load_model(str(hf_checkpoint("qwen2", tie_word_embeddings=True)), dtype="bfloat16")
    model = loaded.model
    assert model.lm_head is None and model._packed_head is not None
    ids = list(range(3, 40))
    kv = PagedKVCache(loaded.kv_layout(16), 4, "cpu")
    batch = ForwardBatch.build([SeqInput(ids, 0, [0, 1, 2], all_logits=True)], 16, "cpu")
    packed = model(batch, kv)
    for m in model.modules():
        if isinstance(m, Linear):
            m.packed = None
    model._packed_head = None
    assert torch.equal(packed, model(batch, kv))
