"""The engine on a CUDA device: what the CPU machines that run CI cannot check.

Skipped where torch sees no CUDA device. On a GPU machine they run as any unit test
(``python -m pytest tests/worker/engine/test_cuda.py``). They hold the CUDA path to
the CPU's numbers in float32 (the CPU path is the one the rest of the suite checks
against transformers), check that KV crosses between engines on different devices
(a prefill on one GPU pool, a decode on another kind of machine), and that ``auto``
picks the GPU and bfloat16 there with a KV pool sized from the device's free memory.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdd.common.kv_codec import KV_CODECS, NO_CODEC
from pdd.worker.engine import Engine
from pdd.worker.engine.config import EngineConfig
from pdd.worker.engine.kv_codec import decode, encode, fp8_supported
from pdd.worker.engine.request import RequestOutput
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import PagedKVCache
from pdd.worker.model.loader import LoadedModel, load_model

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device visible: run on a GPU machine"
    ),
]

BLOCK_SIZE = 16
MAX_TOKENS = 24
#: Ragged lengths: one under a block, several blocks, and one past a 64-token step (chunked).
PROMPTS = [[(i * 7 + k * 31 + 3) % 250 for i in range(n)] for k, n in enumerate((5, 37, 130))]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt_logits(loaded: LoadedModel) -> torch.Tensor:
    """Every position's logits for ``PROMPTS`` as one ragged batch, on the CPU."""
    blocks = [-(-len(p) // BLOCK_SIZE) for p in PROMPTS]
    kv = PagedKVCache(loaded.kv_layout(BLOCK_SIZE), sum(blocks), loaded.device)
    seqs, first = [], 0
    for prompt, n in zip(PROMPTS, blocks, strict=True):
        seqs.append(SeqInput(prompt, 0, list(range(first, first + n)), all_logits=True))
        first += n
    batch = ForwardBatch.build(seqs, BLOCK_SIZE, loaded.device)
    with torch.inference_mode():
        return loaded.model(batch, kv).float().cpu()


@pytest.fixture(scope="module")
def tiny_cuda() -> LoadedModel:
    return load_model("tiny", device="cuda")


def test_fp32_logits_on_cuda_equal_the_cpus(tiny: LoadedModel, tiny_cuda: LoadedModel) -> None:
    assert tiny_cuda.model.lm_head.weight.device.type == "cuda"
    torch.testing.assert_close(prompt_logits(tiny_cuda), prompt_logits(tiny), atol=1e-4, rtol=1e-4)


def test_engine_on_cuda_generates_what_the_cpu_engine_does(
    tiny: LoadedModel, tiny_cuda: LoadedModel, assert_no_leaks: Callable[[Engine], None]
) -> None:
    """Chunked prefill (64-token steps), paged decode and the prefix cache, on the GPU."""
    reference = Engine(tiny, block_size=BLOCK_SIZE, num_blocks=64).generate(PROMPTS, greedy())
    engine = Engine(tiny_cuda, block_size=BLOCK_SIZE, num_blocks=64, max_num_batched_tokens=64)
    assert engine.generate(PROMPTS, greedy()) == reference
    assert engine.generate(PROMPTS, greedy()) == reference  # again, from the prefix cache
    assert_no_leaks(engine)


@pytest.mark.parametrize("sender_on", ["cuda", "cpu"])
def test_kv_crosses_between_a_cuda_and_a_cpu_engine(
    tiny: LoadedModel,
    tiny_cuda: LoadedModel,
    sender_on: str,
    drain: Callable[[Engine], list[RequestOutput]],
    assert_no_leaks: Callable[[Engine], None],
) -> None:
    """P's exported chunks are device-free bytes: the receiver continues exactly."""
    prompt = PROMPTS[2]
    (reference,) = Engine(tiny, block_size=BLOCK_SIZE, num_blocks=64).generate([prompt], greedy())
    on = {"cuda": tiny_cuda, "cpu": tiny}
    sender = Engine(on[sender_on], block_size=BLOCK_SIZE, num_blocks=64)
    receiver = Engine(on["cpu" if sender_on == "cuda" else "cuda"], block_size=8, num_blocks=64)
    rid = sender.add_request(prompt, greedy().with_changes(max_tokens=1), hold_kv=True)
    first = [t for out in drain(sender) for t in out.new_token_ids]
    chunks = list(sender.export_kv(rid, 0, len(prompt), chunk_tokens=48))
    sender.release(rid)
    assert receiver.attach_request(prompt, greedy(), "r1") == 0
    for chunk in chunks:
        receiver.import_kv("r1", chunk)
    receiver.resume("r1", first)
    rest = [t for out in drain(receiver) if out.request_id == "r1" for t in out.new_token_ids]
    assert [*first, *rest] == reference
    assert_no_leaks(sender)
    assert_no_leaks(receiver)


@pytest.mark.parametrize(
    "codec", [c for c in KV_CODECS if c != NO_CODEC and (c != "fp8" or fp8_supported())]
)
def test_kv_coded_on_the_gpu_decodes_on_the_cpu_as_if_coded_there(codec: str) -> None:
    """P codes its WAN KV on its own device; MD may decode it on another. The codes may
    differ from the CPU's only where a value sits on a rounding tie, and never by more
    than the CPU's own coding error."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 100, 2, 32, generator=gen) * 2 + 1
    on_gpu, on_cpu = encode(x.cuda(), codec), encode(x, codec)  # type: ignore[arg-type]
    assert len(on_gpu) == len(on_cpu)
    shape = tuple(x.shape)
    from_gpu = decode(on_gpu, codec, shape, torch.float32, "cpu")  # type: ignore[arg-type]
    from_cpu = decode(on_cpu, codec, shape, torch.float32, "cpu")  # type: ignore[arg-type]
    assert (from_gpu != from_cpu).float().mean().item() < 1e-3
    assert (from_gpu - x).abs().max() <= (from_cpu - x).abs().max() * 1.01


def test_auto_runs_bfloat16_on_the_gpu_with_a_pool_from_free_memory(tiny: LoadedModel) -> None:
    engine = Engine("tiny", EngineConfig(device="auto", kv_cache_memory_fraction=0.02))
    assert engine.device.type == "cuda"
    assert engine.loaded.dtype == torch.bfloat16
    assert engine.dtype_reason == "auto: bfloat16 on CUDA"
    free, _total = torch.cuda.mem_get_info()
    pool_bytes = engine.stats.num_total_blocks * engine.layout.bytes_per_block
    assert 0 < pool_bytes <= 0.02 * (free + pool_bytes) * 1.01
    low, full = prompt_logits(engine.loaded), prompt_logits(tiny)
    torch.testing.assert_close(low, full, atol=0.15, rtol=0.05)
    assert (low.argmax(-1) == full.argmax(-1)).float().mean().item() > 0.9
    assert [len(out) for out in engine.generate(PROMPTS, greedy())] == [MAX_TOKENS] * 3
