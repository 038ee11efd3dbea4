"""bench/engine.py's pure parts: arguments, the vLLM skip, agreement and the printed table.

The timed runs themselves are benchmarks (docs/engine.md), not tests; what is checked here
is that a missing vLLM is a clear skip line, never a crash, and that the figures print.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).parents[2] / "bench"


def _load(name: str):
    # bench/ scripts import each other as top-level modules, as when run as scripts
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


engine_bench = _load("engine")
vllm_baseline = _load("vllm_baseline")


def test_transformers_is_the_default_baseline_and_vllm_is_asked_for(monkeypatch):
    monkeypatch.setenv("PDD_VLLM_PYTHON", "/opt/vllm/bin/python")
    args = engine_bench.parse_args([])
    assert args.baseline == ["transformers"]
    assert args.vllm_python == "/opt/vllm/bin/python"
    assert args.kv_gib == 1
    args = engine_bench.parse_args(["--baseline", "vllm", "--vllm-python", "/x/python"])
    assert args.baseline == ["vllm"]
    assert args.vllm_python == "/x/python"
    both = engine_bench.parse_args(["--baseline", "transformers", "--baseline", "vllm"])
    assert both.baseline == ["transformers", "vllm"]


@pytest.mark.parametrize("argv", [["--baseline", "sglang"], ["--kv-gib", "0"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine_bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_the_vllm_side_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("PDD_VLLM_PYTHON", raising=False)
    for argv, reason in [
        ([], "no --vllm-python given"),
        (["--vllm-python", str(tmp_path / "python")], "is not an executable interpreter"),
    ]:
        args = engine_bench.parse_args(["--baseline", "vllm", *argv])
        vllm, skipped = engine_bench.start_vllm(args, tmp_path, loaded=None, max_len=1024)
        assert vllm is None
        assert reason in skipped
        line = engine_bench.vllm_line({"vllm": {"skipped": skipped}})
        assert line.startswith("vLLM baseline skipped: ") and reason in line


def test_driver_env_preloads_the_bundled_openmp_and_binds_the_threads(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    found = vllm_baseline.VllmEnv(tmp_path, tcmalloc="libtcmalloc_minimal.so.4")
    env = vllm_baseline.driver_env(found, threads=2, kv_gib=3)
    assert env["LD_PRELOAD"] == f"libtcmalloc_minimal.so.4:{tmp_path}/lib/libiomp5.so"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_agreement_counts_tokens_up_to_each_request_s_first_difference():
    ours = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    theirs = [[1, 2, 9, 4], [5, 6], [0, 8, 9]]  # the 4 and the 8, 9 match only by chance
    assert vllm_baseline.token_agreement(ours, theirs) == {
        "equal_tokens": 4,
        "tokens": 9,
        "identical_requests": 1,
        "requests": 3,
    }


def _figures(with_vllm: bool, with_transformers: bool = True) -> dict:
    throughput = {
        "requests": 32,
        "generated_tokens": 4471,
        "ours": 200.0,
        "ours_by_kernels": {"avx512_bf16": 200.0},
    }
    decode = {"ours": 20.0, "ours_by_kernels": {"avx512_bf16": 20.0}}
    if with_transformers:
        throughput |= {
            "transformers": {"one_by_one": 50.0, "padded_batches_of_8": 80.0},
            "transformers_best": "padded_batches_of_8",
            "speedup_vs": {"one_by_one": 4.0, "padded_batches_of_8": 2.5},
            "speedup_vs_best": 2.5,
        }
        decode |= {"transformers": 10.0, "ratio": 2.0}
    vllm: dict = {"skipped": "not asked for (--baseline vllm)"}
    if with_vllm:
        agreement = {"equal_tokens": 4471, "tokens": 4471, "identical_requests": 32, "requests": 32}
        throughput |= {"vllm": 250.0, "ours_over_vllm": 0.8, "vllm_greedy_agreement": agreement}
        decode |= {"vllm": 25.0, "ratio_vllm": 0.8}
        vllm = {"versions": {"vllm": "0.32.0", "torch": "2.13.0+cpu"}}
    extend = {
        "context_tokens": 512,
        "extend_100_ms": 10.0,
        "decode_step_ms": 5.0,
        "prefill_100_ms": 8.0,
        "extend_over_decode": 2.0,
        "extend_over_prefill": 1.25,
    }
    return {
        "model": "llama-200m",
        "dtype": "float32",
        "device": "cpu",
        "torch_threads": 2,
        "allocator": "tcmalloc",
        "kv_gib": 1,
        "repeats": 2,
        "greedy_parity_with_transformers": True,
        "cpu_kernels": ["avx512_bf16"],
        "cpu_flags": ["avx2", "avx512_bf16", "avx512f", "fma"],
        "a_throughput_tok_s": throughput,
        "b_decode_tok_s": decode,
        "c_extend": extend,
        "d_kv_bytes_per_token": {"tiny": {"float32": 2048, "bfloat16": 1024}},
        "vllm": vllm,
    }


def test_the_table_prints_ours_over_vllm_next_to_ours_over_transformers(capsys):
    engine_bench.print_table(_figures(with_vllm=True))
    out = capsys.readouterr().out
    assert "vLLM 0.32.0" in out and "250.0 tok/s  (ours 0.80x)" in out
    assert "transformers 10.0 tok/s (2.00x), vLLM 25.0 tok/s (0.80x)" in out
    assert "greedy tokens equal to vLLM's (float32): 4471/4471 (100.0%)" in out
    assert "32/32 requests identical" in out
    assert "allocator=tcmalloc" in out  # ours' allocator: vLLM's side runs on tcmalloc


def test_without_vllm_the_table_says_it_was_skipped(capsys):
    engine_bench.print_table(_figures(with_vllm=False))
    out = capsys.readouterr().out
    assert "vLLM 0" not in out and "vLLM baseline skipped: not asked for" in out
    assert "transformers 10.0 tok/s (2.00x)\n" in out


def test_vllm_alone_prints_no_transformers_figures(capsys):
    engine_bench.print_table(_figures(with_vllm=True, with_transformers=False))
    out = capsys.readouterr().out
    assert "transformers" not in out.replace("greedy parity with transformers", "")
    assert "(b) single-request decode: ours 20.0 tok/s, vLLM 25.0 tok/s (0.80x)" in out


def test_each_cpu_kernel_variant_gets_its_row_beside_vllm(capsys):
    """``--cpu-kernels avx512_bf16 --cpu-kernels avx2``: a row and a ratio per variant."""
    figures = _figures(with_vllm=True, with_transformers=False)
    figures["a_throughput_tok_s"]["ours_by_kernels"] = {"avx512_bf16": 200.0, "avx2": 125.0}
    figures["b_decode_tok_s"]["ours_by_kernels"] = {"avx512_bf16": 20.0, "avx2": 12.5}
    engine_bench.print_table(figures)
    out = capsys.readouterr().out
    assert "CPU flags: avx2 avx512_bf16 avx512f fma" in out
    assert "ours, CPU kernels avx2" in out and "125.0 tok/s  (0.50x vLLM)" in out
    assert "200.0 tok/s  (0.80x vLLM)" in out
    assert "ours (avx512_bf16) 20.0 tok/s (0.80x vLLM), ours (avx2) 12.5 tok/s (0.50x vLLM)" in out


def test_cpu_kernel_variants_are_checked_arguments():
    args = engine_bench.parse_args(["--cpu-kernels", "avx2", "--cpu-kernels", "off"])
    assert args.cpu_kernels == ["avx2", "off"]
    with pytest.raises(SystemExit):
        engine_bench.parse_args(["--cpu-kernels", "avx9"])
