"""The paged CPU decode kernel: exact attention over scattered blocks, batch-invariant,
used by the model where it applies and SDPA everywhere else."""

from __future__ import annotations

import pytest
import torch

from pdd.worker.model import load_model
from pdd.worker.model import paged_attention as pa
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import PagedKVCache

pytestmark = pytest.mark.unit

KERNEL = pa.load()
needs_kernel = pytest.mark.skipif(
    KERNEL is None,
    reason="the paged attention kernel cannot be built here (no C++ compiler "
    "or no AVX-512); the engine uses SDPA",
)


def _case(dtype: torch.dtype, head_dim: int, group: int, lens: list[int], block_size: int = 16):
    """Queries, one cache layer with K and V in scattered blocks, tables and lengths."""
    gen = torch.Generator().manual_seed(head_dim * 100 + group)
    kv_heads, width = 2, -(-max(lens) // block_size)
    num_blocks = len(lens) * width + 3
    layer = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=gen)
    blocks = torch.randperm(num_blocks, generator=gen)[: len(lens) * width]
    tables = blocks.view(len(lens), width).contiguous()
    q = torch.randn(len(lens), kv_heads, group, head_dim, generator=gen) * 2
    return q.to(dtype), layer.to(dtype), tables, torch.tensor(lens), block_size


def _reference(q, layer, tables, lens, block_size) -> torch.Tensor:
    """Float64 attention per sequence over its own keys, gathered slot by slot."""
    out = torch.empty(q.shape, dtype=torch.float64)
    scale = q.shape[-1] ** -0.5
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = tables[b][pos // block_size] * block_size + pos % block_size
        k, v = layer[0][:, slots].double(), layer[1][:, slots].double()
        weights = torch.softmax(q[b].double() @ k.transpose(-1, -2) * scale, dim=-1)
        out[b] = weights @ v
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "group"), [(16, 1), (64, 4), (128, 7), (96, 2)])
def test_matches_float64_attention_over_scattered_blocks(dtype, head_dim, group) -> None:
    lens = [1, 15, 16, 17, 130]  # a lone key, block edges, several blocks
    q, layer, tables, lens_t, bs = _case(dtype, head_dim, group, lens)
    out = KERNEL.decode_attention(q, layer, tables, lens_t, bs, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    torch.testing.assert_close(
        out.double(), _reference(q, layer, tables, lens_t, bs), atol=tol, rtol=tol
    )


@needs_kernel
def test_a_sequence_gets_the_same_bits_alone_or_in_a_batch() -> None:
    """No reduction spans sequences, so batch composition cannot change a result (the
    pipelines' token equality rests on that)."""
    q, layer, tables, lens, bs = _case(torch.bfloat16, 64, 4, [40, 300, 7, 129])
    together = KERNEL.decode_attention(q, layer, tables, lens, bs, 0.125)
    for b in range(len(lens)):
        alone = KERNEL.decode_attention(
            q[b : b + 1], layer, tables[b : b + 1], lens[b : b + 1], bs, 0.125
        )
        assert torch.equal(alone[0], together[b])


@needs_kernel
def test_reads_queries_sliced_from_the_fused_projection() -> None:
    """A decode step's queries are a strided slice of QKV; the kernel reads them as such."""
    q, layer, tables, lens, bs = _case(torch.float32, 32, 2, [20, 33])
    fused = torch.cat([q.flatten(1), torch.zeros(2, 64)], dim=1)  # [B, H*D + extra]
    sliced = fused[:, : q[0].numel()].view(q.shape)
    assert not sliced.is_contiguous()
    expected = KERNEL.decode_attention(q, layer, tables, lens, bs, 0.2)
    assert torch.equal(KERNEL.decode_attention(sliced, layer, tables, lens, bs, 0.2), expected)


@needs_kernel
def test_refuses_mismatched_inputs_with_a_reason() -> None:
    q, layer, tables, lens, bs = _case(torch.float32, 32, 2, [20, 33])
    with pytest.raises(RuntimeError, match="dtypes differ"):
        KERNEL.decode_attention(q.bfloat16(), layer, tables, lens, bs, 0.2)
    with pytest.raises(RuntimeError, match="int64"):
        KERNEL.decode_attention(q, layer, tables.int(), lens, bs, 0.2)


def test_applies_only_on_the_cpu_to_its_dtypes_and_head_dims(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert pa.decode_attention_kernel(torch.device("cuda"), torch.bfloat16, 64) is None
    assert pa.decode_attention_kernel(cpu, torch.float16, 64) is None
    assert pa.decode_attention_kernel(cpu, torch.bfloat16, 48) is None
    monkeypatch.setenv(pa.ENV_CHOICE, "sdpa")
    assert pa.decode_attention_kernel(cpu, torch.bfloat16, 64) is None
    monkeypatch.delenv(pa.ENV_CHOICE)
    expected = None if KERNEL is None else KERNEL.decode_attention
    assert pa.decode_attention_kernel(cpu, torch.bfloat16, 64) is expected


def test_the_build_directory_follows_the_source(monkeypatch, tmp_path) -> None:
    """A changed kernel source is built afresh, never loaded from an older build."""
    monkeypatch.setenv(pa.ENV_BUILD_DIR, str(tmp_path))
    before = pa.build_directory()
    source = tmp_path / "paged_attention.cpp"
    source.write_text(pa.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(pa, "SOURCE", source)
    assert pa.build_directory() != before and pa.build_directory().parent == tmp_path


def _decode_logits(loaded, kernel_on: bool) -> list[torch.Tensor]:
    """Prefill three prompts, then decode 6 steps of all three together, greedily."""
    model = loaded.model
    model.decode_attention = (
        pa.decode_attention_kernel(loaded.device, loaded.dtype, loaded.config.head_dim)
        if kernel_on
        else None
    )
    layout = loaded.kv_layout(16)
    kv = PagedKVCache(layout, 64, "cpu")
    prompts = [list(range(5, 40)), list(range(100, 103)), list(range(7, 90))]
    tables = [list(range(i * 16, i * 16 + 12)) for i in range(3)]
    logits = model(
        ForwardBatch.build(
            [SeqInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)], 16, "cpu"
        ),
        kv,
    )
    seqs, steps = [list(p) for p in prompts], []
    for _ in range(6):
        nxt = logits.argmax(-1).tolist()
        batch = [SeqInput([n], len(s), t) for n, s, t in zip(nxt, seqs, tables, strict=True)]
        for s, n in zip(seqs, nxt, strict=True):
            s.append(n)
        logits = model(ForwardBatch.build(batch, 16, "cpu"), kv)
        steps.append(logits)
    return steps


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_decodes_through_the_kernel_as_through_sdpa(dtype: str) -> None:
    loaded = load_model("tiny", dtype=dtype)
    assert loaded.model.decode_attention is KERNEL.decode_attention  # the loader chose it
    with_kernel, with_sdpa = _decode_logits(loaded, True), _decode_logits(loaded, False)
    tol = 1e-4 if dtype == "float32" else 5e-2
    for a, b in zip(with_kernel, with_sdpa, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        if dtype == "float32":
            assert torch.equal(a.argmax(-1), b.argmax(-1))
