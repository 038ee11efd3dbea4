"""Grammar engines for structured output, side by side on this CPU.

    python bench/grammar.py [--vocab 32000,128000] [--json OUT]

What the worker pays per generated token under ``response_format: json_schema`` is the
token mask: the grammar engine's pass over the whole vocabulary. This measures it for
each engine that is installed (llguidance through PDD's own sampler hook, which also
unpacks the bitmask into a bool tensor; xgrammar and outlines-core when present), on a
real byte-level BPE vocabulary of 32k and 128k tokens trained here on the Python
standard library's sources (no download), walking a valid JSON document of a small
schema token by token. The other two engines are not dependencies:
``pip install xgrammar outlines-core`` to include them. Figures per engine and vocabulary:

- setup: reading the vocabulary into the engine, once per worker (ms);
- compile: compiling the schema's grammar, once per schema (PDD caches it) (ms);
- mask: median, mean and p99 time to compute one token mask and accept the token
  (ms/token); the first masks after a compile pay for lazy compilation (llguidance),
  so the mean and p99 carry that and any stall of a loaded machine, the median not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tokenizers import Tokenizer

from pdd.testing.tokenizers import train_byte_bpe

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "days", "units", "tags"],
    "additionalProperties": False,
}
DOCUMENT = (
    '{"city":"San Francisco de Asis","days":7,"units":"metric",'
    '"tags":["fog","hills","cable cars","bridges","sourdough"]}'
)

#: One engine: (tokenizer, eos id) -> (a per-token step: token -> None, set-up seconds,
#: compile seconds).
Engine = Callable[[Tokenizer, int], tuple[Callable[[int], None], float, float]]


def corpus() -> Iterator[str]:
    """The standard library's Python sources: megabytes of real text, on every machine."""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def llguidance_engine(tok: Tokenizer, eos: int) -> tuple[Callable[[int], None], float, float]:
    """PDD's own path (``pdd.worker.engine.grammar``): the same calls the sampler makes."""
    from pdd.common.tokenizer import HFTokenizer
    from pdd.common.wire import GuidedDecoding
    from pdd.worker.engine.grammar import GrammarCompiler

    with tempfile.TemporaryDirectory() as d:
        tok.save(f"{d}/tokenizer.json")
        compiler = GrammarCompiler(
            HFTokenizer(Path(d) / "tokenizer.json", [eos]), tok.get_vocab_size()
        )
    t0 = time.perf_counter()
    compiler.start(GuidedDecoding(kind="json_object"))  # the vocabulary is read on first use
    setup_s = time.perf_counter() - t0
    state = compiler.start(GuidedDecoding(kind="json_schema", schema_text=json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t0 - setup_s
    output: list[int] = []

    def step(token: int) -> None:
        state.allowed()
        output.append(token)
        state.advance(output)

    return step, setup_s, compile_s


def xgrammar_engine(tok: Tokenizer, eos: int) -> tuple[Callable[[int], None], float, float]:
    import transformers
    import xgrammar

    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info)
    setup_s = time.perf_counter() - t0
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    matcher = xgrammar.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0 - setup_s
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def step(token: int) -> None:
        matcher.fill_next_token_bitmask(mask)
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")

    return step, setup_s, compile_s


def outlines_core_engine(tok: Tokenizer, eos: int) -> tuple[Callable[[int], None], float, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    byte_of = {v: k for k, v in _byte_level_chars().items()}
    vocab: dict[bytes, list[int]] = {}
    for text, i in tok.get_vocab().items():
        if i != eos:
            vocab.setdefault(bytes(byte_of[c] for c in text), []).append(i)
    vocabulary = Vocabulary(eos, vocab)
    setup_s = time.perf_counter() - t0
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    guide = Guide(index)
    compile_s = time.perf_counter() - t0 - setup_s

    def step(token: int) -> None:
        guide.get_tokens()
        guide.advance(token)

    return step, setup_s, compile_s


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (how byte-level BPE spells its tokens)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


ENGINES: dict[str, Engine] = {
    "llguidance": llguidance_engine,
    "xgrammar": xgrammar_engine,
    "outlines-core": outlines_core_engine,
}


def measure(name: str, engine: Engine, tok: Tokenizer, eos: int) -> dict[str, object]:
    ids = tok.encode(DOCUMENT).ids
    try:
        step, setup_s, compile_s = engine(tok, eos)
    except ImportError as e:
        return {"engine": name, "vocab": tok.get_vocab_size(), "error": f"not installed ({e})"}
    times = []
    for token in ids:
        t0 = time.perf_counter()
        step(token)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "engine": name,
        "vocab": tok.get_vocab_size(),
        "tokens": len(ids),
        "setup_ms": round(setup_s * 1e3, 1),
        "compile_ms": round(compile_s * 1e3, 1),
        "mask_median_ms": round(statistics.median(times) * 1e3, 3),
        "mask_mean_ms": round(statistics.fmean(times) * 1e3, 3),
        "mask_p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", default="32000,128000", help="vocabulary sizes, comma-separated")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    text = list(corpus())
    rows = []
    for size in (int(v) for v in args.vocab.split(",")):
        tok = train_byte_bpe(text, size, ["<s>", "</s>"], bos=None)
        eos = tok.token_to_id("</s>")
        for name in args.engines.split(","):
            rows.append(measure(name, ENGINES[name], tok, eos))
            print(rows[-1], file=sys.stderr)
    head = f"{'engine':<14} {'vocab':>7} {'setup ms':>9} {'compile ms':>11} {'median ms':>10}"
    print(f"{head} {'mean ms':>8} {'p99 ms':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<14} {r['vocab']:>7} {r['error']}")
            continue
        print(
            f"{r['engine']:<14} {r['vocab']:>7} {r['setup_ms']:>9} {r['compile_ms']:>11} "
            f"{r['mask_median_ms']:>10} {r['mask_mean_ms']:>8} {r['mask_p99_ms']:>8}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
