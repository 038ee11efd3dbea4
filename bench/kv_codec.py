"""The WAN KV codecs: bytes, speed on this CPU, and quality on transformers-written checkpoints.

    python bench/kv_codec.py [--prompts 4] [--max-tokens 64] [--train-steps 200]
                             [--threads 2] [--stack] [--json OUT]

Three tables, and a fourth with ``--stack``:

* **size and speed** for real model shapes in bfloat16 (Llama-3-8B, Qwen2-7B,
  Qwen3-8B), one chunk of 256 tokens: the coded bytes as a fraction of the exact
  KV, and encode / decode time per MB of exact KV (what P and MD spend per MB on the
  engine's device, here the CPU);
* **quality** on two kinds of Llama / Qwen2 / Qwen3 checkpoints the tests write
  (tests/worker/checkpoints.py, float32): ``random`` weights (random token prompts)
  and ``trained`` ones (``--train-steps`` on the synthetic corpus, seconds to minutes
  on this CPU; prompts from that corpus), greedy, ``--max-tokens`` per prompt:
  next-token logit error (max / mean abs), KL(exact || coded) averaged over the
  generated positions, teacher-forced and free-running token agreement (see
  ``bench/kv_codec_quality.py``);
* **flips**: per checkpoint and codec, the exact top-1 minus top-2 logit margins over
  all teacher-forced positions (1%, 10%, 50% quantiles), the RMS of the codec's change
  of that gap, and for every teacher-forced flip its margin, the share of positions
  with a smaller margin, its gap shift and its largest logit error;
* **through the stack** (``--stack``): the same checkpoints end to end, as ``pdd up``
  runs them (the operator's render, router, P, RLD, MD, the emulated WAN line): the
  corpus prompts as token IDs through mono and through pdd with each codec
  (``pdd.bench.greedy_agreement``); per codec the greedy agreement with mono, the
  pipelines the router chose, and the WAN KV bytes as sent against ``none``'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from kv_codec_quality import CodecQuality, measure

from pdd.bench.greedy_agreement import StackGreedy, run_greedy
from pdd.common.kv_codec import KV_CODECS, chunk_wire_bytes
from pdd.local.cluster import free_port
from pdd.local.topology import StackConfig
from pdd.worker.engine.kv_codec import decode, encode, fp8_supported
from pdd.worker.model.loader import load_model

#: (layers, KV heads, head dim) of real checkpoints, from their config.json.
SHAPES = {"llama-3-8b": (32, 8, 128), "qwen2-7b": (28, 4, 128), "qwen3-8b": (36, 8, 128)}
CHUNK_TOKENS = 256
ARCHS = ("llama", "qwen2", "qwen3")
KINDS = ("random", "trained")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--train-steps", type=int, default=200, help="training of the trained kind")
    p.add_argument("--kinds", default=",".join(KINDS), help="checkpoint kinds to measure")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per codec and shape")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--stack", action="store_true", help="also run the --kinds checkpoints through stacks"
    )
    p.add_argument("--json", type=Path)
    return p.parse_args()


def codecs() -> list[str]:
    return [c for c in KV_CODECS if c != "fp8" or fp8_supported()]


def size_and_speed(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, (layers, heads, dim) in SHAPES.items():
        x = torch.randn(layers, 2, CHUNK_TOKENS, heads, dim).to(torch.bfloat16)
        raw = chunk_wire_bytes("none", layers, CHUNK_TOKENS, heads, dim, 2)
        for codec in codecs():
            payload = encode(x, codec)  # type: ignore[arg-type]
            enc = _median_s(lambda c=codec, x=x: encode(x, c), repeats)
            dec = _median_s(
                lambda c=codec, b=payload, s=tuple(x.shape): decode(b, c, s, torch.bfloat16, "cpu"),
                repeats,
            )
            mb = raw / 2**20
            rows.append({
                "shape": name, "codec": codec, "ratio": len(payload) / raw,
                "encode_ms_per_mb": 1000 * enc / mb, "decode_ms_per_mb": 1000 * dec / mb,
            })  # fmt: skip
    return rows


class Checkpoints:
    """The test checkpoints (tests/worker/checkpoints.py), each written or trained once,
    with the prompts each kind is measured on."""

    def __init__(self, root: Path, num_prompts: int, train_steps: int) -> None:
        self.module = _test_checkpoints()
        self.root, self.num_prompts, self.train_steps = root, num_prompts, train_steps
        self.vocab = self.module.BASE_CONFIG["vocab_size"]
        self._paths: dict[tuple[str, str], Path] = {}

    def path(self, kind: str, arch: str) -> Path:
        if (kind, arch) not in self._paths:
            out = self.root / kind
            out.mkdir(exist_ok=True)
            self._paths[kind, arch] = (
                self.module.train_hf_checkpoint(out, arch, steps=self.train_steps)
                if kind == "trained"
                else self.module.write_hf_checkpoint(out, arch)
            )
        return self._paths[kind, arch]

    def prompts(self, kind: str, arch: str) -> list[list[int]]:
        """Held-out corpus samples for the trained kind (the same for every arch); random
        token IDs for the other, drawn from one seeded stream in ``ARCHS`` order, so each
        arch gets its own (as the documented figures were measured)."""
        if kind == "trained":
            return self.module.corpus_prompts(self.vocab, self.num_prompts)
        rng = random.Random(0)
        drawn = [
            [[rng.randrange(2, self.vocab) for _ in range(rng.randrange(60, 120))]
             for _ in range(self.num_prompts)]
            for _ in range(ARCHS.index(arch) + 1)
        ]  # fmt: skip
        return drawn[-1]


def quality(ckpts: Checkpoints, max_tokens: int, kinds: list[str]) -> list[dict[str, Any]]:
    rows = []
    for kind in kinds:
        for arch in ARCHS:
            loaded = load_model(str(ckpts.path(kind, arch)), "float32")
            for codec in codecs():
                if codec != "none":
                    q = measure(loaded, ckpts.prompts(kind, arch), codec, max_tokens)  # type: ignore[arg-type]
                    rows.append(_quality_row(kind, arch, codec, q))
    return rows


def through_stacks(
    ckpts: Checkpoints, max_tokens: int, kinds: list[str], logs: Path
) -> list[dict[str, Any]]:
    """Per checkpoint: mono, then pdd with every codec, the same prompts."""
    rows = []
    for kind in kinds:
        for arch in ARCHS:
            runs: dict[str, StackGreedy] = {}
            for mode, codec in [("mono", "none"), *(("pdd", c) for c in codecs())]:
                config = StackConfig(
                    mode=mode,  # type: ignore[arg-type]
                    model=str(ckpts.path(kind, arch)),
                    port=free_port(),
                    log_dir=logs / f"{kind}-{arch}-{mode}-{codec}",
                    kv_codec=codec,  # type: ignore[arg-type]
                )
                runs[mode if mode == "mono" else codec] = run_greedy(
                    config, ckpts.prompts(kind, arch), max_tokens, say=lambda _: None
                )
            rows += [_stack_row(kind, arch, codec, runs) for codec in codecs()]
    return rows


def _stack_row(kind: str, arch: str, codec: str, runs: dict[str, StackGreedy]) -> dict[str, Any]:
    run, mono = runs[codec], runs["mono"]
    return {
        "kind": kind, "arch": arch, "codec": codec, "pipelines": dict(run.pipelines),
        "agreement": run.agreement_with(mono),
        "differing_outputs": run.outputs_differing_from(mono), "outputs": len(run.outputs),
        "wan_kv_bytes": run.wan_kv_bytes, "wan_kv_wire_bytes": run.wan_kv_wire_bytes,
        "vs_none": run.wan_kv_wire_bytes / runs["none"].wan_kv_wire_bytes,
    }  # fmt: skip


def _quality_row(kind: str, arch: str, codec: str, q: CodecQuality) -> dict[str, Any]:
    return {
        "kind": kind, "arch": arch, "codec": codec, "next_max_abs": q.next_max_abs,
        "next_mean_abs": q.next_mean_abs, "kl": q.kl, "forced_agreement": q.forced_agreement,
        "free_agreement": q.free_agreement, "tokens": q.total,
        "flip_margins": list(q.flip_margins),
        "margin_quantiles": [q.margin_quantile(f) for f in (0.01, 0.1, 0.5)],
        "gap_shift_rms": q.gap_shift_rms,
        "forced_flips": [asdict(f) for f in q.forced_flips],
    }  # fmt: skip


def _test_checkpoints() -> Any:
    """tests/worker/checkpoints.py (one source for the tests' checkpoints and these)."""
    path = Path(__file__).parents[1] / "tests" / "worker" / "checkpoints.py"
    spec = importlib.util.spec_from_file_location("pdd_test_checkpoints", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _margins(margins: list[float]) -> str:
    return f"{len(margins)}: " + ", ".join(f"{m:.4f}" for m in margins) if margins else "0"


def _median_s(fn: Any, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    sizes = size_and_speed(args.repeats)
    print(f"size and speed: one chunk of {CHUNK_TOKENS} tokens, bfloat16, "
          f"{args.threads} CPU threads")  # fmt: skip
    print(f"{'shape':<12} {'codec':<6} {'bytes':>7} {'encode ms/MB':>13} {'decode ms/MB':>13}")
    for r in sizes:
        print(f"{r['shape']:<12} {r['codec']:<6} {r['ratio']:>6.3f}x "
              f"{r['encode_ms_per_mb']:>13.2f} {r['decode_ms_per_mb']:>13.2f}")  # fmt: skip
    tmp = tempfile.TemporaryDirectory()
    ckpts = Checkpoints(Path(tmp.name), args.prompts, args.train_steps)
    kinds = args.kinds.split(",")
    qual = quality(ckpts, args.max_tokens, kinds)
    print(f"\nquality: {args.prompts} prompts x {args.max_tokens} greedy tokens per checkpoint")
    print(f"{'kind':<8} {'arch':<6} {'codec':<6} {'max|dlogit|':>11} {'mean|dlogit|':>12} "
          f"{'KL nats':>9} {'forced':>7} {'free':>7}  "
          "free-run flips (exact top-2 margin there)")  # fmt: skip
    for r in qual:
        print(f"{r['kind']:<8} {r['arch']:<6} {r['codec']:<6} {r['next_max_abs']:>11.4f} "
              f"{r['next_mean_abs']:>12.5f} {r['kl']:>9.2e} {100 * r['forced_agreement']:>6.1f}% "
              f"{100 * r['free_agreement']:>6.1f}%  {_margins(r['flip_margins'])}")  # fmt: skip
    print("\nteacher-forced flips: exact top-2 margin vs all positions' margins, gap shift")
    print(f"{'kind':<8} {'arch':<6} {'codec':<6} {'margin p1':>10} {'p10':>8} {'p50':>8} "
          f"{'gap shift rms':>13}  "
          "flips: margin (share of positions below) gap shift / max|dlogit|")  # fmt: skip
    for r in qual:
        p1, p10, p50 = r["margin_quantiles"]
        flips = "; ".join(
            f"{f['margin']:.4f} ({100 * f['rank']:.1f}%) {f['gap_shift']:+.4f}/{f['max_abs']:.4f}"
            for f in r["forced_flips"]
        )
        print(f"{r['kind']:<8} {r['arch']:<6} {r['codec']:<6} {p1:>10.4f} {p10:>8.4f} {p50:>8.4f} "
              f"{r['gap_shift_rms']:>13.5f}  {flips or 'none'}")  # fmt: skip
    stacks = []
    if args.stack:
        stacks = through_stacks(ckpts, args.max_tokens, kinds, Path(tmp.name) / "logs")
    if stacks:
        print(f"\nthrough the stack: {args.prompts} prompts x {args.max_tokens} greedy "
              "tokens, pdd against mono")  # fmt: skip
        print(f"{'kind':<8} {'arch':<6} {'codec':<6} {'agree':>7} {'differ':>7} "
              f"{'wire bytes':>11} {'vs none':>8}  pipelines")  # fmt: skip
        for r in stacks:
            pipes = ", ".join(f"{k} {v}" for k, v in sorted(r["pipelines"].items()))
            print(f"{r['kind']:<8} {r['arch']:<6} {r['codec']:<6} {100 * r['agreement']:>6.2f}% "
                  f"{r['differing_outputs']:>3}/{r['outputs']:<3} {r['wan_kv_wire_bytes']:>11,.0f} "
                  f"{r['vs_none']:>7.3f}x  {pipes}")  # fmt: skip
    tmp.cleanup()
    if args.json:
        document = {"size_and_speed": sizes, "quality": qual, "through_the_stack": stacks}
        args.json.write_text(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
