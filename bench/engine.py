"""Engine benchmark: our engine against transformers ``generate``, side by side.

    python bench/engine.py [--model tiny|DIR] [--dtype D] [--device cpu|cuda] [--json OUT]

Both sides run the SAME weights in the same dtype on the same device. For the
``tiny`` preset the engine's seeded weights are copied into a transformers
``LlamaForCausalLM`` (after a greedy parity check); a checkpoint directory is
loaded by both. Timed figures are the best of ``--repeats`` rounds that
alternate between the two sides, so both see the same (shared) machine load.
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
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdd.worker.engine import Engine
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.config import ModelConfig, tiny_config
from pdd.worker.model.loader import LoadedModel, load_model


def _test_checkpoint_config() -> dict:
    """The config tests/worker/checkpoints.py writes (one source for both)."""
    path = Path(__file__).parents[1] / "tests" / "worker" / "checkpoints.py"
    spec = importlib.util.spec_from_file_location("pdd_test_checkpoints", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BASE_CONFIG


TEST_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default=None, help="float32|bfloat16|float16 (default: model's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=2, help="rounds per timed figure (best kept)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args()


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


def ours_throughput(engine: Engine, reqs: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs]
    engine.reset_prefix_cache()  # every round starts cold: no prompt is cached
    seconds = timed(lambda: engine.generate([p for p, _ in reqs], params), engine.device)
    return sum(n for _, n in reqs) / seconds


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
    engine: Engine, hf: torch.nn.Module, reqs: list[tuple[list[int], int]], repeats: int
) -> tuple[float, dict[str, float]]:
    """Best tok/s of each side over ``repeats`` alternating rounds (ours, then transformers)."""
    engine.generate([reqs[0][0][:16]], SamplingParams(max_tokens=4))  # warm-up
    hf_generate(hf, [reqs[0][0][:16]], 4)
    ours, theirs = 0.0, {}
    for _ in range(repeats):
        ours = max(ours, ours_throughput(engine, reqs))
        for name, tps in hf_throughput(hf, reqs, engine.device).items():
            theirs[name] = max(theirs.get(name, 0.0), tps)
    return ours, theirs


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


def decode_rounds(
    engine: Engine, hf: torch.nn.Module, prompt: list[int], new: int, repeats: int
) -> dict[str, float]:
    """Best single-request decode tok/s of each side over ``repeats`` alternating rounds."""
    ours = theirs = 0.0
    for _ in range(repeats):
        ours = max(ours, ours_decode_rate(engine, prompt, new))
        theirs = max(theirs, hf_decode_rate(hf, prompt, new, engine.device))
    return {"ours": ours, "transformers": theirs, "ratio": ours / theirs}


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


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    device = torch.device(loaded.device)
    hf = hf_model(args.model, loaded)
    c = loaded.config
    max_len = min(c.max_position_embeddings, 1024)
    engine = Engine(loaded, max_num_batched_tokens=2048, max_running=args.requests)

    probe = workload(1, c.vocab_size, max_len, args.seed)[0][0][:32]
    parity = engine.generate([probe], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    parity_ok = parity == hf_generate(hf, [probe], 16)[0]
    engine.reset_prefix_cache()

    reqs = workload(args.requests, c.vocab_size, max_len, args.seed)
    ours_tps, hf_tps = throughput_rounds(engine, hf, reqs, args.repeats)
    best_hf = max(hf_tps, key=hf_tps.get)
    prompt = reqs[0][0][:128]
    figures = {
        "model": args.model,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "greedy_parity_with_transformers": parity_ok,
        "a_throughput_tok_s": {
            "requests": args.requests,
            "generated_tokens": sum(n for _, n in reqs),
            "ours": ours_tps,
            "transformers": hf_tps,
            "transformers_best": best_hf,
            "speedup_vs": {name: ours_tps / tps for name, tps in hf_tps.items()},
            "speedup_vs_best": ours_tps / hf_tps[best_hf],
        },
        "b_decode_tok_s": decode_rounds(engine, hf, prompt, 128, args.repeats),
        "c_extend": extend_ratios(engine, context=min(512, max_len // 2)),
        "d_kv_bytes_per_token": kv_bytes_per_token(),
    }
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


def print_table(f: dict) -> None:
    a, b, c = f["a_throughput_tok_s"], f["b_decode_tok_s"], f["c_extend"]
    print(
        f"model={f['model']} dtype={f['dtype']} device={f['device']} "
        f"threads={f['torch_threads']} best of {f['repeats']} rounds"
    )
    print(f"greedy parity with transformers: {f['greedy_parity_with_transformers']}")
    print(f"(a) mixed workload, {a['requests']} requests, {a['generated_tokens']} generated tokens")
    print(f"    {'ours':<45} {a['ours']:10.1f} tok/s")
    for name, tps in a["transformers"].items():
        speedup = a["speedup_vs"][name]
        print(f"    {'transformers ' + name:<45} {tps:10.1f} tok/s  (ours {speedup:.2f}x)")
    print(
        f"    speedup vs best transformers ({a['transformers_best']}): {a['speedup_vs_best']:.2f}x"
    )
    print(f"(b) single-request decode: ours {b['ours']:.1f} tok/s, ", end="")
    print(f"transformers {b['transformers']:.1f} tok/s ({b['ratio']:.2f}x)")
    print(
        f"(c) extend 100 tokens after {c['context_tokens']}: {c['extend_100_ms']:.2f} ms = "
        f"{c['extend_over_decode']:.2f} decode steps ({c['decode_step_ms']:.2f} ms) = "
        f"{c['extend_over_prefill']:.2f} x a 100-token prefill ({c['prefill_100_ms']:.2f} ms)"
    )
    print("(d) KV bytes per token:")
    for name, sizes in f["d_kv_bytes_per_token"].items():
        print(f"    {name:<12} fp32 {sizes['float32']:6d}  bf16 {sizes['bfloat16']:6d}")


if __name__ == "__main__":
    main()
