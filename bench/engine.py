"""Engine benchmark: our engine against transformers ``generate``, side by side.

    python bench/engine.py [--model tiny|llama-200m|DIR] [--dtype D] [--device cpu|cuda]
        [--baseline transformers|vllm ...] [--vllm-python PY] [--kv-gib N] [--json OUT]

Both sides run the SAME weights in the same dtype on the same device. For the
``tiny`` preset the engine's seeded weights are copied into a transformers
``LlamaForCausalLM`` (after a greedy parity check); a checkpoint directory is
loaded by both; a preset (``llama-200m``) is written once as a checkpoint under
``--checkpoint-root`` and loaded like one. Timed figures are the best of ``--repeats``
rounds that alternate between the sides, so all see the same (shared) machine load.
Figures:

(a) throughput on a mixed workload (32 requests, prompts 16-512 tokens, outputs
    16-256, fixed seed, EOS ignored): ours with continuous batching against each
    of three transformers baselines and the best of them: one request at a time,
    and left-padded batches of 8 in arrival order or grouped by (known) output
    length; a batch runs to its longest output and only requested tokens count;
(b) single-request decode tokens/s;
(c) one extend over 100 tokens (after a cached context) divided by one decode
    step, and divided by a 100-token prefill;
(d) KV bytes per token of the tiny preset and the test checkpoints' configs.

``--baseline`` picks who (a) and (b) time ours against: transformers (the default),
vLLM, or both (``--baseline transformers --baseline vllm``). vLLM runs in another
interpreter (``--vllm-python``, a virtual environment with vLLM; bench/vllm_baseline.py) on the same
checkpoint, dtype, prompts (token ids), output lengths, batch limits, KV budget and
thread count, in the same alternating rounds; it also prints how many of vLLM's greedy
tokens equal ours (exact in float32). Where that interpreter cannot import vLLM the vLLM
side is skipped with the reason.

``--cpu-kernels`` times ours once per compiled CPU kernel variant named (``avx2``,
``avx512``, ``avx512_bf16``; ``off`` for torch's ops), in the same alternating rounds,
e.g. the AVX2 variant beside the AVX-512 one on an AVX-512 machine; the first named is
the one the other figures (extend, parity, vLLM agreement) use. The default: the
variant the worker would choose here (``$PDD_CPU_KERNELS``, else the CPU's widest).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from vllm_baseline import VllmBaseline, VllmUnavailableError, driver_env, probe, token_agreement

from pdd.worker.cpu_allocator import reexec_with_tcmalloc, tcmalloc_loaded
from pdd.worker.engine import Engine
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model import cpu_kernels
from pdd.worker.model.config import ModelConfig, tiny_config
from pdd.worker.model.loader import LoadedModel, load_model


def _test_checkpoints() -> ModuleType:
    """tests/worker/checkpoints.py: its config and its writer (one source for both)."""
    path = Path(__file__).parents[1] / "tests" / "worker" / "checkpoints.py"
    spec = importlib.util.spec_from_file_location("pdd_test_checkpoints", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _test_checkpoint_config() -> dict:
    return _test_checkpoints().BASE_CONFIG


# Presets written once as real checkpoints (random weights at trained-model scale, written
# by transformers) so that every side, vLLM included, loads the same files.
PRESETS: dict[str, dict] = {
    # issue 19's 200M Llama: the size where per-step overhead and matmuls both show
    "llama-200m": {
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 2048,
    },
}


def preset_checkpoint(name: str, root: Path) -> Path:
    """The preset's bf16 checkpoint under ``root``, written on first use (seed 0)."""
    directory = root / name
    if not (directory / "config.json").exists():
        written = _test_checkpoints().write_hf_checkpoint(
            root / f"{name}.tmp", "llama", dtype=torch.bfloat16, **PRESETS[name]
        )
        written.rename(directory)  # complete or absent: a killed write is redone
        written.parent.rmdir()
    return directory


BASELINES = ("transformers", "vllm")
#: The CPU flags that decide the kernels' variant and bf16's speed (printed with figures).
VECTOR_FLAGS = frozenset(
    {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
     "amx_bf16", "amx_tile"}
)  # fmt: skip
TEST_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help=f"tiny, {', '.join(PRESETS)} or a directory")
    p.add_argument(
        "--checkpoint-root",
        type=Path,
        default=Path(tempfile.gettempdir()) / "pdd-bench",
        help="where presets are written once",
    )
    p.add_argument("--dtype", default=None, help="float32|bfloat16|float16 (default: model's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=2, help="rounds per timed figure (best kept)")
    p.add_argument("--kv-gib", type=int, default=1, help="KV cache GiB, ours and vLLM's")
    p.add_argument(
        "--baseline",
        action="append",
        choices=BASELINES,
        help="time this engine against ours; repeat for several (default: transformers, "
        "which also checks greedy parity on one short request in any case)",
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("PDD_VLLM_PYTHON"),
        help="interpreter of a virtual environment with vLLM (default: $PDD_VLLM_PYTHON)",
    )
    p.add_argument(
        "--cpu-kernels",
        action="append",
        choices=[*cpu_kernels.BY_NAME, "off"],
        help="time ours with this CPU kernel variant; repeat for several, side by side "
        "(default: the one the worker chooses here)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    args.baseline = args.baseline or ["transformers"]
    if args.kv_gib < 1:
        p.error(f"--kv-gib must be >= 1, got {args.kv_gib}")
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


# --- the transformers side ----------------------------------------------------------------------
def hf_model(source: str, ours: LoadedModel) -> torch.nn.Module:
    """transformers' model with our weights: loaded from DIR, or tiny's copied over."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if source != "tiny":
        model = AutoModelForCausalLM.from_pretrained(source, dtype=ours.dtype)
        return model.to(ours.device).eval()
    c = ours.config
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids),
    )
    model = LlamaForCausalLM(config).to(dtype=ours.dtype)
    model.load_state_dict(unfused_state_dict(ours))
    return model.to(ours.device).eval()


def unfused_state_dict(ours: LoadedModel) -> dict[str, torch.Tensor]:
    """Our state dict with fused qkv / gate_up split back into transformers' names."""
    c = ours.config
    qkv_sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    state = {}
    for name, tensor in ours.model.state_dict().items():
        if ".qkv_proj." in name:
            for part, t in zip(
                ("q_proj", "k_proj", "v_proj"), tensor.split(qkv_sizes), strict=True
            ):
                state[name.replace("qkv_proj", part)] = t
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True):
                state[name.replace("gate_up_proj", part)] = t
        else:
            state[name] = tensor
    return state


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy, EOS ignored, left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[:, width:].tolist()


# --- (a) mixed workload -------------------------------------------------------------------------
def workload(n: int, vocab: int, max_len: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt_len = rng.randint(16, min(512, max_len // 2))
        out_len = rng.randint(16, min(256, max_len - prompt_len))
        reqs.append(([rng.randrange(3, vocab) for _ in range(prompt_len)], out_len))
    return reqs


def ours_throughput(
    engine: Engine, reqs: list[tuple[list[int], int]]
) -> tuple[float, list[list[int]]]:
    """tok/s of one cold round, and the tokens (compared with vLLM's)."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs]
    engine.reset_prefix_cache()  # every round starts cold: no prompt is cached
    outputs: list[list[int]] = []
    seconds = timed(
        lambda: outputs.extend(engine.generate([p for p, _ in reqs], params)), engine.device
    )
    return sum(n for _, n in reqs) / seconds, outputs


def run_batches(model: torch.nn.Module, batches: list[list[tuple[list[int], int]]]) -> None:
    for batch in batches:
        hf_generate(model, [p for p, _ in batch], max(n for _, n in batch))


def hf_throughput(model: torch.nn.Module, reqs: list[tuple[list[int], int]], device) -> dict:
    tokens = sum(n for _, n in reqs)
    one_by_one = timed(lambda: [hf_generate(model, [p], n) for p, n in reqs], device)
    figures = {"one_by_one": tokens / one_by_one}
    orders = {
        "padded_batches_of_8": reqs,
        "padded_batches_of_8_by_out_len": sorted(reqs, key=lambda r: r[1]),
    }
    for name, order in orders.items():
        batches = [order[i : i + 8] for i in range(0, len(order), 8)]
        seconds = timed(lambda b=batches: run_batches(model, b), device)
        figures[name] = tokens / seconds
    return figures


def throughput_rounds(
    engine: Engine,
    hf: torch.nn.Module | None,
    reqs: list[tuple[list[int], int]],
    repeats: int,
    vllm: VllmBaseline | None = None,
    variants: list[str] | None = None,
) -> dict:
    """Best tok/s of each side over ``repeats`` alternating rounds (ours once per CPU
    kernel variant in ``variants``, transformers unless ``hf`` is None, vLLM unless
    ``vllm`` is), and vLLM's greedy agreement with ours (both sides are deterministic)."""
    variants = variants or [kernels_label(engine)]
    engine.generate([reqs[0][0][:16]], SamplingParams(max_tokens=4))  # warm-up
    if hf is not None:
        hf_generate(hf, [reqs[0][0][:16]], 4)
    tokens = sum(n for _, n in reqs)
    best: dict = {"ours": 0.0, "transformers": {}, "ours_by_kernels": dict.fromkeys(variants, 0.0)}
    for _ in range(repeats):
        for variant in reversed(variants):  # the first last: its kernels stay in place
            use_kernels(engine, variant)
            tps, ours_out = ours_throughput(engine, reqs)
            best["ours_by_kernels"][variant] = max(best["ours_by_kernels"][variant], tps)
        best["ours"] = best["ours_by_kernels"][variants[0]]
        for name, tps in hf_throughput(hf, reqs, engine.device).items() if hf else ():
            best["transformers"][name] = max(best["transformers"].get(name, 0.0), tps)
        if vllm is not None:
            seconds, vllm_out = vllm.generate([p for p, _ in reqs], [n for _, n in reqs])
            if list(map(len, vllm_out)) != [n for _, n in reqs]:  # else its tok/s would lie
                raise RuntimeError("vLLM returned other output lengths than were asked for")
            best["vllm"] = max(best.get("vllm", 0.0), tokens / seconds)
            best["vllm_agreement"] = token_agreement(ours_out, vllm_out)
    return best


# --- (b) single-request decode, (c) extend ------------------------------------------------------
def ours_decode_rate(engine: Engine, prompt: list[int], new: int) -> float:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=new, ignore_eos=True))
    engine.step()  # prefill + first token
    seconds = timed(lambda: [engine.step() for _ in range(new - 1)], engine.device)
    assert not engine.has_unfinished(), rid
    return (new - 1) / seconds


def hf_decode_rate(model: torch.nn.Module, prompt: list[int], new: int, device) -> float:
    full = timed(lambda: hf_generate(model, [prompt], new), device)
    first = timed(lambda: hf_generate(model, [prompt], 1), device)
    return (new - 1) / (full - first)


def vllm_decode_rate(vllm: VllmBaseline, prompt: list[int], new: int) -> float:
    """As transformers' figure: a run of ``new`` tokens less a run of one (prefill)."""
    full, _ = vllm.generate([prompt], [new])
    first, _ = vllm.generate([prompt], [1])
    return (new - 1) / (full - first)


def decode_rounds(
    engine: Engine,
    hf: torch.nn.Module | None,
    prompt: list[int],
    new: int,
    repeats: int,
    vllm: VllmBaseline | None = None,
    variants: list[str] | None = None,
) -> dict:
    """Best single-request decode tok/s of each side over ``repeats`` alternating rounds
    (ours once per CPU kernel variant in ``variants``)."""
    variants = variants or [kernels_label(engine)]
    theirs = theirs_vllm = 0.0
    by_kernels = dict.fromkeys(variants, 0.0)
    for _ in range(repeats):
        for variant in reversed(variants):
            use_kernels(engine, variant)
            rate = ours_decode_rate(engine, prompt, new)
            by_kernels[variant] = max(by_kernels[variant], rate)
        ours = by_kernels[variants[0]]
        if hf is not None:
            theirs = max(theirs, hf_decode_rate(hf, prompt, new, engine.device))
        if vllm is not None:
            theirs_vllm = max(theirs_vllm, vllm_decode_rate(vllm, prompt, new))
    figures: dict = {"ours": ours, "ours_by_kernels": by_kernels}
    if hf is not None:
        figures |= {"transformers": theirs, "ratio": ours / theirs}
    if vllm is not None:
        figures |= {"vllm": theirs_vllm, "ratio_vllm": ours / theirs_vllm}
    return figures


def kernels_label(engine: Engine) -> str:
    """The CPU kernel variant the engine's model runs now ("off": torch's ops)."""
    kernels = engine.loaded.model.kernels
    return kernels.variant if kernels is not None else "off"


def use_kernels(engine: Engine, variant: str) -> None:
    """Run the engine's model through ``variant``'s kernels from the next step on (the
    engine decides per step whether a batch is built for them)."""
    if variant == kernels_label(engine):
        return
    loaded = engine.loaded
    kernels = cpu_kernels.kernels_for(
        loaded.device, loaded.dtype, loaded.config.head_dim, None if variant == "off" else variant
    )
    if variant == "off":
        kernels = None
    elif kernels is None or kernels.variant != variant:
        raise SystemExit(f"CPU kernels {variant} cannot run here (see the log line above)")
    loaded.model.kernels = kernels


def extend_ratios(engine: Engine, context: int, k: int = 100, reps: int = 5) -> dict:
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    ctx = [rng.randrange(3, vocab) for _ in range(context)]
    rid = engine.add_request(ctx, SamplingParams(max_tokens=k * (reps + 2) + 50, ignore_eos=True))
    engine.step()
    decode = statistics.median(timed(engine.step, engine.device) for _ in range(20))
    extend = []
    for _ in range(reps):
        engine.extend(rid, [rng.randrange(3, vocab) for _ in range(k - 1)])  # + the sampled one
        extend.append(timed(engine.step, engine.device))
    engine.abort(rid)
    prefill = []
    for _ in range(reps):
        engine.reset_prefix_cache()
        pid = engine.add_request([rng.randrange(3, vocab) for _ in range(k)], SamplingParams())
        prefill.append(timed(engine.step, engine.device))
        engine.abort(pid)
    e, p = statistics.median(extend), statistics.median(prefill)
    return {
        "context_tokens": context,
        "extend_100_ms": e * 1e3,
        "decode_step_ms": decode * 1e3,
        "prefill_100_ms": p * 1e3,
        "extend_over_decode": e / decode,
        "extend_over_prefill": e / p,
    }


# --- (d) KV bytes per token ---------------------------------------------------------------------
def kv_bytes_per_token() -> dict[str, dict[str, int]]:
    configs = {"tiny": tiny_config()}
    test_config = _test_checkpoint_config()
    for name, arch in TEST_ARCHS.items():
        configs[f"test-{name}"] = ModelConfig.from_hf_dict({**test_config, "architectures": [arch]})
    return {
        name: {"float32": c.kv_bytes_per_token(4), "bfloat16": c.kv_bytes_per_token(2)}
        for name, c in configs.items()
    }


MAX_BATCHED_TOKENS = 2048  # per-step token budget, ours and vLLM's


def vllm_checkpoint(source: str, hf: torch.nn.Module, root: Path) -> Path:
    """A directory vLLM can load: the checkpoint itself, or ``tiny`` saved by transformers."""
    if source != "tiny":
        return Path(source)
    hf.save_pretrained(root / "tiny")
    return root / "tiny"


def start_vllm(
    args: argparse.Namespace, checkpoint: Path, loaded: LoadedModel, max_len: int
) -> tuple[VllmBaseline | None, str | None]:
    """vLLM on the same checkpoint and limits as ours, or None and why it cannot run."""
    try:
        found = probe(args.vllm_python)
        settings = {
            "checkpoint": str(checkpoint.resolve()),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "max_model_len": max_len,
            "max_num_seqs": args.requests,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "seed": args.seed,
        }
        env = driver_env(found, torch.get_num_threads(), args.kv_gib)
        log = args.checkpoint_root / "vllm-driver.log"
        return VllmBaseline(args.vllm_python, settings, env, log), None
    except VllmUnavailableError as e:
        return None, str(e)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.checkpoint_root.mkdir(parents=True, exist_ok=True)
    source = args.model
    if source in PRESETS:
        source = str(preset_checkpoint(source, args.checkpoint_root))
    loaded = load_model(source, dtype=args.dtype, device=args.device)
    hf = hf_model(source, loaded)
    c = loaded.config
    max_len = min(c.max_position_embeddings, 1024)
    engine = Engine(
        loaded,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_running_requests=args.requests,
        kv_budget_bytes=args.kv_gib * 2**30,
    )
    vllm, vllm_skipped = None, "not asked for (--baseline vllm)"
    if "vllm" in args.baseline:
        checkpoint = vllm_checkpoint(source, hf, args.checkpoint_root)
        vllm, vllm_skipped = start_vllm(args, checkpoint, loaded, max_len)
    try:
        figures = run(args, engine, hf, max_len, vllm)
    finally:
        if vllm is not None:
            vllm.close()
    figures["vllm"] = {"skipped": vllm_skipped} if vllm is None else {"versions": vllm.versions}
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


def run(
    args: argparse.Namespace,
    engine: Engine,
    hf: torch.nn.Module,
    max_len: int,
    vllm: VllmBaseline | None,
) -> dict:
    """Every figure, in the order the docstring lists them."""
    c = engine.model_config
    probe_prompt = workload(1, c.vocab_size, max_len, args.seed)[0][0][:32]
    parity = engine.generate([probe_prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    parity_ok = parity == hf_generate(hf, [probe_prompt], 16)[0]
    engine.reset_prefix_cache()

    reqs = workload(args.requests, c.vocab_size, max_len, args.seed)
    timed_hf = hf if "transformers" in args.baseline else None
    variants = args.cpu_kernels or [kernels_label(engine)]
    best = throughput_rounds(engine, timed_hf, reqs, args.repeats, vllm, variants)
    ours_tps, hf_tps = best["ours"], best["transformers"]
    throughput = {
        "requests": args.requests,
        "generated_tokens": sum(n for _, n in reqs),
        "ours": ours_tps,
        "ours_by_kernels": best["ours_by_kernels"],
    }
    if hf_tps:
        best_hf = max(hf_tps, key=hf_tps.get)
        throughput |= {
            "transformers": hf_tps,
            "transformers_best": best_hf,
            "speedup_vs": {name: ours_tps / tps for name, tps in hf_tps.items()},
            "speedup_vs_best": ours_tps / hf_tps[best_hf],
        }
    if vllm is not None:
        throughput |= {
            "vllm": best["vllm"],
            "ours_over_vllm": ours_tps / best["vllm"],
            "vllm_greedy_agreement": best["vllm_agreement"],
        }
    prompt = reqs[0][0][:128]
    return {
        "model": args.model,
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "torch_threads": torch.get_num_threads(),
        "allocator": "tcmalloc" if tcmalloc_loaded() else "glibc",
        "kv_gib": args.kv_gib,
        "repeats": args.repeats,
        "greedy_parity_with_transformers": parity_ok,
        "a_throughput_tok_s": throughput,
        "cpu_kernels": variants,
        "cpu_flags": sorted(cpu_kernels.cpu_flags() & VECTOR_FLAGS),
        "b_decode_tok_s": decode_rounds(
            engine, timed_hf, prompt, 128, args.repeats, vllm, variants
        ),
        "c_extend": extend_ratios(engine, context=min(512, max_len // 2)),
        "d_kv_bytes_per_token": kv_bytes_per_token(),
    }


def print_table(f: dict) -> None:
    a, b, c = f["a_throughput_tok_s"], f["b_decode_tok_s"], f["c_extend"]
    print(
        f"model={f['model']} dtype={f['dtype']} device={f['device']} "
        f"threads={f['torch_threads']} allocator={f['allocator']} "
        f"kv={f['kv_gib']} GiB best of {f['repeats']} rounds"
    )
    print(f"greedy parity with transformers: {f['greedy_parity_with_transformers']}")
    print(f"CPU flags: {' '.join(f['cpu_flags']) or 'none of interest'}")
    print(f"(a) mixed workload, {a['requests']} requests, {a['generated_tokens']} generated tokens")
    vllm_tps, by_kernels = a.get("vllm"), a["ours_by_kernels"]
    for variant, tps in by_kernels.items():
        name = f"ours, CPU kernels {variant}" if len(by_kernels) > 1 else "ours"
        versus = f"  ({tps / vllm_tps:.2f}x vLLM)" if vllm_tps and len(by_kernels) > 1 else ""
        print(f"    {name:<45} {tps:10.1f} tok/s{versus}")
    for name, tps in a.get("transformers", {}).items():
        speedup = a["speedup_vs"][name]
        print(f"    {'transformers ' + name:<45} {tps:10.1f} tok/s  (ours {speedup:.2f}x)")
    if "transformers" in a:
        best, speedup = a["transformers_best"], a["speedup_vs_best"]
        print(f"    speedup vs best transformers ({best}): {speedup:.2f}x")
    if "vllm" in a:
        name = f"vLLM {f['vllm']['versions']['vllm']}"
        print(f"    {name:<45} {a['vllm']:10.1f} tok/s  (ours {a['ours_over_vllm']:.2f}x)")
    decode = [f"ours {b['ours']:.1f} tok/s"]
    if len(b["ours_by_kernels"]) > 1:
        decode = [
            f"ours ({variant}) {tps:.1f} tok/s"
            + (f" ({tps / b['vllm']:.2f}x vLLM)" if "vllm" in b else "")
            for variant, tps in b["ours_by_kernels"].items()
        ]
    if "transformers" in b:
        decode.append(f"transformers {b['transformers']:.1f} tok/s ({b['ratio']:.2f}x)")
    if "vllm" in b:
        decode.append(f"vLLM {b['vllm']:.1f} tok/s ({b['ratio_vllm']:.2f}x)")
    print("(b) single-request decode: " + ", ".join(decode))
    print(
        f"(c) extend 100 tokens after {c['context_tokens']}: {c['extend_100_ms']:.2f} ms = "
        f"{c['extend_over_decode']:.2f} decode steps ({c['decode_step_ms']:.2f} ms) = "
        f"{c['extend_over_prefill']:.2f} x a 100-token prefill ({c['prefill_100_ms']:.2f} ms)"
    )
    print("(d) KV bytes per token:")
    for name, sizes in f["d_kv_bytes_per_token"].items():
        print(f"    {name:<12} fp32 {sizes['float32']:6d}  bf16 {sizes['bfloat16']:6d}")
    print(vllm_line(f))


def vllm_line(f: dict) -> str:
    """The vLLM verdict: its greedy agreement with ours, or why it did not run."""
    if "skipped" in f["vllm"]:
        return f"vLLM baseline skipped: {f['vllm']['skipped']}"
    g = f["a_throughput_tok_s"]["vllm_greedy_agreement"]
    share = g["equal_tokens"] / g["tokens"] if g["tokens"] else 1.0
    return (
        f"greedy tokens equal to vLLM's ({f['dtype']}): {g['equal_tokens']}/{g['tokens']} "
        f"({share:.1%}) before a request's first difference, "
        f"{g['identical_requests']}/{g['requests']} requests identical"
    )


if __name__ == "__main__":
    reexec_with_tcmalloc()  # ours on the allocator `pdd worker` runs with, where installed
    main()
