"""The compiled CPU kernels: exact attention over scattered blocks, fused row-wise ops
that round as the eager ones do, batch-invariant, used by the model where they apply
and torch's ops everywhere else. Every test of a kernel runs each variant this CPU can
run of the two widths (on an AVX-512 machine: its AVX-512 variant and the AVX2 one),
chosen explicitly."""

from __future__ import annotations

import pytest
import torch

from pdd.worker.model import cpu_kernels as ck
from pdd.worker.model import load_model
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import KVLayout, PagedKVCache
from pdd.worker.model.layers import MLP, RMSNorm
from pdd.worker.model.rope import apply_rotary

pytestmark = pytest.mark.unit

# The widest variant this CPU runs and, if that is not it, the AVX2 one (every x86 CPU
# with AVX-512 has AVX2). Loaded (built once per machine, cached) at collection, before
# the unit tier's no-child-process guard.
VARIANTS = list(dict.fromkeys(v for v in [*ck.runnable()[:1], "avx2"] if v in ck.runnable()))
MODULES = {v: ck.load(v) for v in VARIANTS}
BUILT = [v for v in VARIANTS if MODULES[v] is not None]
by_variant = pytest.mark.parametrize(
    "variant",
    BUILT
    or [
        pytest.param(
            "none",
            marks=pytest.mark.skip(
                reason="no CPU kernel variant can be built here (no C++ compiler, or neither "
                "AVX-512 nor AVX2 + FMA + F16C); the engine uses torch's ops"
            ),
        )
    ],
)


@pytest.fixture
def kernel(variant: str):
    """The built module of ``variant``."""
    return MODULES[variant]


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


@by_variant
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "group"), [(16, 1), (64, 4), (128, 7), (96, 2)])
def test_matches_float64_attention_over_scattered_blocks(kernel, dtype, head_dim, group) -> None:
    lens = [1, 15, 16, 17, 130]  # a lone key, block edges, several blocks
    q, layer, tables, lens_t, bs = _case(dtype, head_dim, group, lens)
    out = kernel.paged_attention(q, layer, tables, lens_t, bs, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    torch.testing.assert_close(
        out.double(), _reference(q, layer, tables, lens_t, bs), atol=tol, rtol=tol
    )


@by_variant
def test_a_sequence_gets_the_same_bits_alone_or_in_a_batch(kernel) -> None:
    """No reduction spans sequences, so batch composition cannot change a result (the
    pipelines' token equality rests on that)."""
    q, layer, tables, lens, bs = _case(torch.bfloat16, 64, 4, [40, 300, 7, 129])
    together = kernel.paged_attention(q, layer, tables, lens, bs, 0.125)
    for b in range(len(lens)):
        alone = kernel.paged_attention(
            q[b : b + 1], layer, tables[b : b + 1], lens[b : b + 1], bs, 0.125
        )
        assert torch.equal(alone[0], together[b])


@by_variant
def test_reads_queries_sliced_from_the_fused_projection(kernel) -> None:
    """A decode step's queries are a strided slice of QKV; the kernel reads them as such."""
    q, layer, tables, lens, bs = _case(torch.float32, 32, 2, [20, 33])
    fused = torch.cat([q.flatten(1), torch.zeros(2, 64)], dim=1)  # [B, H*D + extra]
    sliced = fused[:, : q[0].numel()].view(q.shape)
    assert not sliced.is_contiguous()
    expected = kernel.paged_attention(q, layer, tables, lens, bs, 0.2)
    assert torch.equal(kernel.paged_attention(sliced, layer, tables, lens, bs, 0.2), expected)


@by_variant
def test_refuses_mismatched_inputs_with_a_reason(kernel) -> None:
    q, layer, tables, lens, bs = _case(torch.float32, 32, 2, [20, 33])
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernel.paged_attention(q.bfloat16(), layer, tables, lens, bs, 0.2)
    with pytest.raises(RuntimeError, match="int64"):
        kernel.paged_attention(q, layer, tables.int(), lens, bs, 0.2)


def test_apply_only_on_the_cpu_to_their_dtypes(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert ck.kernels_for(torch.device("cuda"), torch.bfloat16, 64) is None
    assert ck.kernels_for(cpu, torch.float16, 64) is None
    monkeypatch.setenv(ck.ENV_CHOICE, "off")
    assert ck.kernels_for(cpu, torch.bfloat16, 64) is None


@by_variant
def test_the_variant_asked_for_is_the_one_that_runs(kernel, variant, monkeypatch) -> None:
    cpu = torch.device("cpu")
    chosen = ck.kernels_for(cpu, torch.bfloat16, 64, variant=variant)
    assert chosen.variant == variant and chosen.paged_attention is kernel.paged_attention
    odd_head = ck.kernels_for(cpu, torch.bfloat16, 48, variant=variant)  # no instantiation
    assert odd_head.paged_attention is None and odd_head.rms_norm is kernel.rms_norm
    monkeypatch.setenv(ck.ENV_CHOICE, variant)  # what a benchmark or a test run sets
    assert ck.kernels_for(cpu, torch.float32, 64).rms_norm is kernel.rms_norm


def test_the_build_target_follows_the_source_and_the_variant(monkeypatch, tmp_path) -> None:
    """A changed kernel source is built afresh, never loaded from an older build; each
    variant has its own build."""
    monkeypatch.setenv(ck.ENV_BUILD_DIR, str(tmp_path))
    avx2, avx512 = ck.BY_NAME["avx2"], ck.BY_NAME["avx512"]
    before = ck.build_target(avx2)
    assert ck.build_target(avx512).name != before.name
    source = tmp_path / "cpu_kernels.cpp"
    source.write_text(ck.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(ck, "SOURCE", source)
    after = ck.build_target(avx2)
    assert after.name != before.name and after.root == tmp_path


# --- row-wise ops: the eager modules with and without the kernels ---------------------
ROW_SHAPES = [(1, 1024), (7, 40), (33, 16), (3, 5)]  # a decode row, masked tails, tiny rows


def _kernels(dtype: torch.dtype, variant: str) -> ck.CpuKernels:
    return ck.kernels_for(torch.device("cpu"), dtype, 64, variant=variant)


@by_variant
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ROW_SHAPES)
def test_rms_norm_and_its_residual_add_round_as_the_eager_ops(variant, dtype, shape) -> None:
    gen = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    norm = RMSNorm(shape[1], 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[1], generator=gen) + 0.5)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(norm(x, _kernels(dtype, variant)), norm(x), **tol)
    eager_out, eager_sum = norm.add(x, residual.clone())
    in_place = residual.clone()
    out, total = norm.add(x, in_place, _kernels(dtype, variant))
    assert total is in_place and torch.equal(total, eager_sum)  # the add rounds as x + r
    torch.testing.assert_close(out, eager_out, **tol)


@by_variant
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_rounds_as_the_eager_ops(kernel, dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(9, 2 * 37, generator=gen) * 4).to(dtype)  # 37: a masked tail
    gate, up = gate_up.split(37, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    torch.testing.assert_close(kernel.silu_and_mul(gate_up), expected, **tol)


@by_variant
def test_row_ops_give_a_row_the_same_bits_alone_or_in_a_batch(kernel) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 1024, generator=gen).bfloat16()
    weight = torch.rand(1024, generator=gen).bfloat16()
    together, gate_up = kernel.rms_norm(x, weight, 1e-5), torch.cat([x, x.flip(0)], dim=1)
    products = kernel.silu_and_mul(gate_up)
    for r in (0, 17, 63):
        assert torch.equal(kernel.rms_norm(x[r : r + 1], weight, 1e-5)[0], together[r])
        assert torch.equal(kernel.silu_and_mul(gate_up[r : r + 1])[0], products[r])


@by_variant
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_and_cache_rotates_and_writes_as_the_eager_ops(kernel, dtype, head_dim) -> None:
    """Same bits as apply_rotary + PagedKVCache.write: q returned, k and v in the cache."""
    gen = torch.Generator().manual_seed(head_dim)
    t, heads, kv_heads = 6, 4, 2
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(t, 1, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([9, 2, 30, 31, 0, 17])
    layout = KVLayout(1, kv_heads, head_dim, 8, dtype)
    eager_kv, fused_kv = PagedKVCache(layout, 4, "cpu"), PagedKVCache(layout, 4, "cpu")
    split = qkv.view(t, -1, head_dim)
    rotated = apply_rotary(split[:, : heads + kv_heads], cos, sin)
    eager_kv.write(0, slots, rotated[:, heads:], split[:, heads + kv_heads :])
    q = kernel.rope_and_cache(
        qkv, cos.view(t, -1), sin.view(t, -1), fused_kv.layer(0), slots, heads
    )
    assert torch.equal(q, rotated[:, :heads])
    assert torch.equal(fused_kv.layer(0), eager_kv.layer(0))


@by_variant
def test_mlp_runs_through_silu_and_mul(variant) -> None:
    config = load_model("tiny").config
    mlp = MLP(config)
    x = torch.randn(5, config.hidden_size)
    kernels = _kernels(torch.float32, variant)
    torch.testing.assert_close(mlp(x, kernels), mlp(x), atol=1e-5, rtol=1e-5)


# --- the whole model ---------------------------------------------------------------------
def _decode_logits(
    loaded, variant: str | None, fed: list[list[int]] | None = None
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill three prompts, then decode 6 steps of all three together through the
    kernels of ``variant`` (None: torch's ops): the logits of each step and the tokens fed.
    The tokens are this run's greedy picks, or ``fed``'s, so that two runs compared see the
    same inputs (in bf16 two paths may pick differently where random weights leave close
    logits, and every later step would then differ by more than rounding)."""
    model, kernels_on = loaded.model, variant is not None
    model.kernels = (
        ck.kernels_for(loaded.device, loaded.dtype, loaded.config.head_dim, variant)
        if kernels_on
        else None
    )
    layout = loaded.kv_layout(16)
    kv = PagedKVCache(layout, 64, "cpu")
    prompts = [list(range(5, 40)), list(range(100, 103)), list(range(7, 90))]
    tables = [list(range(i * 16, i * 16 + 12)) for i in range(3)]
    first = [SeqInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    logits = model(ForwardBatch.build(first, 16, "cpu", paged=kernels_on), kv)
    seqs, steps, picks = [list(p) for p in prompts], [logits], []
    for step in range(6):
        nxt = logits.argmax(-1).tolist() if fed is None else fed[step]
        picks.append(nxt)
        batch = [SeqInput([n], len(s), t) for n, s, t in zip(nxt, seqs, tables, strict=True)]
        for s, n in zip(seqs, nxt, strict=True):
            s.append(n)
        logits = model(ForwardBatch.build(batch, 16, "cpu", paged=kernels_on), kv)
        steps.append(logits)
    return steps, picks


@by_variant
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_runs_through_the_kernels_as_through_torchs_ops(
    kernel, variant, dtype: str, monkeypatch
) -> None:
    monkeypatch.setenv(ck.ENV_CHOICE, variant)
    loaded = load_model("tiny", dtype=dtype)
    assert loaded.model.kernels.variant == variant  # the loader chose them
    assert loaded.model.kernels.paged_attention is kernel.paged_attention
    eager, picks = _decode_logits(loaded, None)
    with_kernels, _ = _decode_logits(loaded, variant, picks)
    tol = 1e-4 if dtype == "float32" else 5e-2
    for a, b in zip(with_kernels, eager, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        if dtype == "float32":
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_paged_batch_needs_a_model_with_the_kernel() -> None:
    loaded = load_model("tiny", dtype="float32")
    loaded.model.kernels = None
    kv = PagedKVCache(loaded.kv_layout(16), 4, "cpu")
    batch = ForwardBatch.build([SeqInput([1, 2], 0, [0])], 16, "cpu", paged=True)
    with pytest.raises(ValueError, match="paged CPU kernel"):
        loaded.model(batch, kv)
