"""Device, dtype and KV cache size resolved from settings, with the machine faked.

The CUDA branches run here with a ``DeviceProbe`` that claims a GPU; the engine-level
tests run on the CPU and check that what the engine reports is what it was given.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdd.worker.engine import Engine, EngineConfigError, PromptTooLongError
from pdd.worker.engine.config import DEFAULT_CPU_KV_BYTES
from pdd.worker.engine.device import (
    DeviceProbe,
    _cpu_has_bf16,
    _mem_available_bytes,
    kv_budget_bytes,
    resolve_device,
    resolve_dtype,
)

pytestmark = pytest.mark.unit

GIB = 2**30


def probe(cuda: bool = False, free: int = 8 * GIB, bf16: bool = False) -> DeviceProbe:
    return DeviceProbe(lambda: cuda, lambda device: free, lambda: bf16)


def test_auto_device_is_cuda_exactly_when_one_is_visible():
    assert resolve_device("auto", probe(cuda=True)) == torch.device("cuda")
    assert resolve_device("auto", probe(cuda=False)) == torch.device("cpu")
    assert resolve_device("cuda:1", probe(cuda=True)) == torch.device("cuda:1")


@pytest.mark.parametrize(("requested", "message"), [("cuda", "nvidia.com/gpu"), ("tpu", "one of")])
def test_a_device_the_machine_lacks_is_refused_with_the_fix(requested, message):
    with pytest.raises(EngineConfigError, match=message):
        resolve_device(requested, probe(cuda=False))


def test_auto_dtype_is_bf16_on_cuda_and_the_checkpoints_own_on_a_bf16_cpu():
    assert resolve_dtype("auto", torch.device("cuda"), probe(cuda=True)).name == "bfloat16"
    assert resolve_dtype(None, torch.device("cuda"), probe(cuda=True)).name == "bfloat16"
    on_bf16_cpu = resolve_dtype("auto", torch.device("cpu"), probe(bf16=True))
    assert on_bf16_cpu.name is None and on_bf16_cpu.warning is None
    assert resolve_dtype("float16", torch.device("cuda"), probe(cuda=True)).name == "float16"


def test_auto_dtype_is_float32_on_a_cpu_without_native_bf16():
    """bf16 is emulated there (slower than fp32): weights and KV in fp32, said why."""
    choice = resolve_dtype("auto", torch.device("cpu"), probe(bf16=False))
    assert choice.name == "float32" and choice.warning is None
    assert "no native bfloat16" in choice.reason


def test_bf16_on_a_cpu_without_it_runs_only_when_asked_with_a_warning():
    asked = resolve_dtype("bfloat16", torch.device("cpu"), probe(bf16=False))
    assert asked.name == "bfloat16" and "emulated" in asked.warning
    assert "dtype auto would run float32" in asked.warning
    native = resolve_dtype("bfloat16", torch.device("cpu"), probe(bf16=True))
    assert native.name == "bfloat16" and native.warning is None


def test_kv_budget_is_the_fraction_of_free_memory():
    assert kv_budget_bytes(0.5, torch.device("cuda"), probe(cuda=True, free=80 * GIB)) == 40 * GIB
    with pytest.raises(EngineConfigError, match=r"\(0, 1\]"):
        kv_budget_bytes(1.5, torch.device("cuda"), probe(cuda=True))


def test_the_system_probe_reads_the_kernels_words(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable: 2048 kB\n")
    assert _mem_available_bytes(meminfo) == 2048 * 1024
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")
    assert not _cpu_has_bf16(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    assert _cpu_has_bf16(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")  # Arm
    assert _cpu_has_bf16(cpuinfo)


def test_the_engine_reports_the_kv_capacity_it_was_given(tiny):
    """A fraction of (faked) free memory, an explicit size and the CPU default each
    give exactly the blocks that fit, and ``info()`` reports them."""
    free = 64 * 2**20
    by_fraction = Engine(
        "tiny", device="auto", kv_cache_memory_fraction=0.25, probe=probe(free=free)
    )
    info = by_fraction.info()
    per_block = by_fraction.layout.bytes_per_block
    assert info.device == "cpu" and info.dtype == "float32"
    assert info.kv_blocks == (free // 4) // per_block
    assert info.kv_tokens == info.kv_blocks * info.block_size
    assert info.kv_bytes == info.kv_blocks * per_block <= free // 4
    explicit = Engine(tiny, kv_budget_bytes=3 * per_block + 1).info()
    assert explicit.kv_blocks == 3
    assert Engine(tiny).info().kv_blocks == DEFAULT_CPU_KV_BYTES // per_block


def test_a_kv_size_the_device_cannot_hold_is_a_setting_to_change_not_an_oom(tiny):
    """Refused as EngineConfigError (the worker then stays up not ready, saying why)."""
    with pytest.raises(EngineConfigError, match=r"2\.00 GiB was asked for, but cpu has 1\.00 GiB"):
        Engine(tiny, kv_budget_bytes=2 * GIB, probe=probe(free=1 * GIB))
    per_block = Engine(tiny, kv_budget_bytes=GIB // 64).layout.bytes_per_block
    with pytest.raises(EngineConfigError, match="below one block"):
        Engine(tiny, kv_budget_bytes=per_block - 1)


def test_limits_are_reported_and_enforced(tiny):
    engine = Engine(tiny, max_running_requests=5, max_prompt_tokens=20, max_num_batched_tokens=64)
    info = engine.info()
    limits = (info.max_running_requests, info.max_prompt_tokens, info.max_num_batched_tokens)
    assert limits == (5, 20, 64)
    engine.add_request(list(range(2, 22)))  # 20 tokens: fits
    with pytest.raises(PromptTooLongError, match="at most 20"):
        engine.add_request(list(range(2, 23)))
    assert Engine(tiny).info().max_prompt_tokens == info.max_model_len - 1


def test_a_bf16_checkpoint_runs_in_float32_on_a_cpu_without_native_bf16(hf_checkpoint, caplog):
    """``dtype: auto``: weights and KV in fp32 there, and ``info()`` (``/health``) says why;
    bf16 only when asked, with a warning; on a bf16 CPU the checkpoint's own dtype."""
    ckpt = hf_checkpoint("llama", dtype=torch.bfloat16)
    plain = Engine(str(ckpt), kv_budget_bytes=GIB // 64, probe=probe(bf16=False))
    info = plain.info()
    assert (info.dtype, plain.layout.dtype) == ("float32", torch.float32)  # weights and KV
    assert "no native bfloat16" in info.dtype_reason
    assert Engine(str(ckpt), kv_budget_bytes=GIB // 64, probe=probe(bf16=True)).info().dtype == (
        "bfloat16"
    )
    with caplog.at_level("WARNING"):
        asked = Engine(str(ckpt), dtype="bfloat16", kv_budget_bytes=GIB // 64, probe=probe())
    assert asked.info().dtype == "bfloat16" and asked.info().dtype_reason.startswith("asked")
    assert any("emulated" in r.getMessage() for r in caplog.records)
