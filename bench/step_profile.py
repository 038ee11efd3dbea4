"""Step profile: time the engine's real steps so ``pdd calibrate`` can fit the simulator.

    python bench/step_profile.py --out OUT.json [--model tiny|DIR] [--device cpu|cuda]
        [--dtype D] [--grid small|default|large] [--repeats 5] [--threads N]

Three kinds of step, each on a grid of shapes, each timed as ONE ``Engine.step()``
(scheduling, the batched forward pass and sampling: what a serving step costs):

* prefill: n new tokens after c tokens the prefix cache holds;
* decode: b running sequences of about c tokens each, one new token each;
* extend: m handed-over tokens recomputed in one pass after c computed ones (MD's
  catch-up after a relay).

Each point runs once untimed (warm-up), then ``--repeats`` times; the median seconds
is kept. The shape fields are read back from the engine (the cache hit it reported,
the contexts of the running decodes), so they describe the step that ran; a decode's
context grows by a token per step, so its fields are the mean over the repeats.
The JSON is ``pdd.simulator.calibration.StepProfile``; ``docs/calibration.md`` says
how to fit it. The default grid takes well under a minute for ``tiny`` on 2 CPU threads.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from engine import timed  # bench/engine.py: the timer that synchronises CUDA around a call

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.common.cost_model import kv_bytes_per_token
from pdd.simulator.calibration import ProfiledModel, StepProfile, StepSample
from pdd.worker.engine import Engine
from pdd.worker.engine.request import RequestOutput
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.loader import LoadedModel, load_model


@dataclass(frozen=True)
class Grid:
    """The shapes profiled; cached lengths are multiples of DEFAULT_BLOCK_SIZE."""

    prefill_new: tuple[int, ...]
    prefill_cached: tuple[int, ...]
    decode_batch: tuple[int, ...]
    decode_context: tuple[int, ...]
    extend_new: tuple[int, ...]
    extend_cached: tuple[int, ...]


GRIDS = {
    "small": Grid((32, 128), (0, 256), (1, 8), (128, 512), (32,), (256,)),
    "default": Grid(
        (16, 64, 256, 1024), (0, 512, 2048), (1, 4, 16, 32), (128, 512, 2048),
        (16, 64, 256), (512, 2048),
    ),
    "large": Grid(
        (16, 64, 256, 1024, 4096), (0, 1024, 4096, 16384), (1, 8, 32, 64), (256, 1024, 4096),
        (16, 64, 256, 1024), (1024, 4096, 16384),
    ),
}  # fmt: skip

Shape = tuple[float, float, float]  # new_tokens, kv_read_tokens, attention_pairs
Timings = tuple[list[Shape], list[float]]  # per timed step (the warm-up dropped)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="write the profile JSON here")
    p.add_argument("--model", default="tiny", help="tiny or a checkpoint directory")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default=None, help="float32|bfloat16|float16 (default: model's)")
    p.add_argument("--grid", choices=GRIDS, default="default", help="how many shapes to time")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per shape (median kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# --- the three kinds of step --------------------------------------------------------------------
def prefill_shape(new: int, cached: int) -> Shape:
    """What InstanceShape.prefill_seconds passes to step_seconds (extends alike)."""
    return new, cached + new, new * cached + new * new / 2


def profile_prefill(engine: Engine, rng: random.Random, n: int, c: int, repeats: int) -> Timings:
    """Steps that prefill n fresh tokens after a cached c-token prefix."""
    prefix = tokens(engine, rng, c)
    if c:
        engine.generate([prefix], SamplingParams(max_tokens=1))  # now the cache holds it
    shapes, times = [], []
    for _ in range(repeats + 1):
        engine.add_request(prefix + tokens(engine, rng, n), SamplingParams(max_tokens=1))
        seconds, outs = timed_step(engine)
        times.append(seconds)
        if len(outs) != 1 or not outs[0].finished:
            raise RuntimeError(f"prefill of {n} after {c} did not finish in one step")
        hit = outs[0].num_cached_tokens
        shapes.append(prefill_shape(c + n - hit, hit))
    return shapes[1:], times[1:]


def profile_decode(engine: Engine, rng: random.Random, b: int, c: int, repeats: int) -> Timings:
    """Decode steps of b sequences whose prompts held c tokens each."""
    new = decode_tokens(b, c, engine.config.max_num_batched_tokens, repeats)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    ids = {engine.add_request(tokens(engine, rng, c), params) for _ in range(b)}
    started: set[str] = set()
    while started != ids:  # prefill every sequence (early ones decode meanwhile)
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    shapes, times = [], []
    for _ in range(repeats + 1):
        running = engine.scheduler.running
        if len(running) != b or any(r.num_uncomputed != 1 for r in running):
            raise RuntimeError(f"decode batch of {b} at {c}: not every sequence is decoding")
        context = sum(r.num_computed + 1 for r in running)  # the new token attends to itself
        shapes.append((b, context, context))
        times.append(timed(engine.step, engine.device))
    for rid in ids:
        engine.abort(rid)
    return shapes[1:], times[1:]


def profile_extend(engine: Engine, rng: random.Random, m: int, c: int, repeats: int) -> Timings:
    """Steps that recompute m handed-over tokens after c computed ones, then sample."""
    prompt = tokens(engine, rng, c)
    shapes, times = [], []
    for _ in range(repeats + 1):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=m + 2, ignore_eos=True))
        while not engine.step():  # prefill (from the cache after the first) and sample
            pass
        engine.extend(rid, tokens(engine, rng, m - 1))  # + the sampled one: m to compute
        (req,) = engine.scheduler.running
        shapes.append(prefill_shape(req.num_uncomputed, req.num_computed))
        times.append(timed(engine.step, engine.device))
        engine.abort(rid)
    return shapes[1:], times[1:]


def timed_step(engine: Engine) -> tuple[float, list[RequestOutput]]:
    outs: list[RequestOutput] = []
    return timed(lambda: outs.extend(engine.step()), engine.device), outs


def sample(kind: str, shapes: list[Shape], times: list[float]) -> StepSample:
    new, kv, pairs = (statistics.fmean(column) for column in zip(*shapes, strict=True))
    return StepSample(
        kind=kind,
        new_tokens=new,
        kv_read_tokens=kv,
        attention_pairs=pairs,
        seconds=statistics.median(times),
    )


def tokens(engine: Engine, rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, engine.model_config.vocab_size) for _ in range(n)]


# --- the run ------------------------------------------------------------------------------------
def decode_tokens(b: int, c: int, budget: int, repeats: int) -> int:
    """max_tokens of a decode point's requests: the first ones decode while the others
    prefill (about b*c/budget steps, more as decodes eat into the budget), then the repeats."""
    return 2 * math.ceil(b * c / budget) + repeats + 8


def points(grid: Grid, max_len: int, budget: int, repeats: int) -> list[tuple[str, int, int]]:
    """(kind, n or b or m, c) for every shape whose sequences fit the context window."""
    pts = [("prefill", n, c) for c in grid.prefill_cached for n in grid.prefill_new]
    pts += [("decode", b, c) for c in grid.decode_context for b in grid.decode_batch]
    pts += [("extend", m, c) for c in grid.extend_cached for m in grid.extend_new]
    longest = {
        "prefill": lambda x, c: c + x,
        "decode": lambda b, c: c + decode_tokens(b, c, budget, repeats),
        "extend": lambda m, c: c + m + 2,
    }
    return [(k, x, c) for k, x, c in pts if longest[k](x, c) < max_len]


def pool_blocks(pts: list[tuple[str, int, int]], budget: int, repeats: int) -> int:
    """KV blocks for the largest point, with room for what the point leaves in the cache
    (its earlier repeats) so that no timed step has to evict."""
    need = 0
    for kind, x, c in pts:
        if kind == "decode":
            need = max(need, x * (c + decode_tokens(x, c, budget, repeats)))
        else:
            need = max(need, c + (x + 2) * (repeats + 2))
    return math.ceil(need * 1.25 / DEFAULT_BLOCK_SIZE) + 64


def profiled_model(loaded: LoadedModel) -> ProfiledModel:
    """ModelSpec fields from the loaded checkpoint.

    active_params_b counts the non-embedding parameters (not the input embedding nor the
    LM head, which a prefill applies to one token per sequence); weight_gb counts all.
    """
    c = loaded.config
    params = dict(loaded.model.named_parameters())
    embeddings = {"model.embed_tokens.weight", "lm_head.weight"}
    kv_bytes = kv_bytes_per_token(
        c.num_layers, c.num_kv_heads, c.head_dim, torch.empty((), dtype=loaded.dtype).element_size()
    )
    return ProfiledModel(
        name=c.name or "unnamed",
        active_params_b=sum(p.numel() for n, p in params.items() if n not in embeddings) / 1e9,
        weight_gb=sum(p.numel() * p.element_size() for p in params.values()) / 1e9,
        kv_bytes_per_token=kv_bytes,
        attention_flops_per_pair=4 * c.num_layers * c.num_heads * c.head_dim,
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({torch.get_num_threads()} threads)"


PROFILERS = {"prefill": profile_prefill, "decode": profile_decode, "extend": profile_extend}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    grid = GRIDS[args.grid]
    max_len = loaded.config.max_position_embeddings
    budget = max(2048, *grid.prefill_new, *grid.extend_new)
    pts = points(grid, max_len, budget, args.repeats)
    engine = Engine(
        loaded,
        block_size=DEFAULT_BLOCK_SIZE,
        num_blocks=pool_blocks(pts, budget, args.repeats),
        max_num_batched_tokens=budget,
        max_running_requests=max(grid.decode_batch),
    )
    rng = random.Random(args.seed)
    engine.generate([tokens(engine, rng, 64)], SamplingParams(max_tokens=8))  # warm-up
    samples = []
    print(f"{'kind':<8} {'x':>5} {'c':>6} {'ms':>9}   (x: new tokens, or batch for decode)")
    for kind, x, c in pts:
        engine.reset_prefix_cache()
        samples.append(sample(kind, *PROFILERS[kind](engine, rng, x, c, args.repeats)))
        print(f"{kind:<8} {x:>5} {c:>6} {samples[-1].seconds * 1e3:>9.3f}", flush=True)
    profile = StepProfile(
        device=device_name(engine.device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        model=profiled_model(loaded),
        samples=samples,
    )
    args.out.write_text(profile.model_dump_json(indent=2))
    print(f"wrote {len(samples)} samples to {args.out}")


if __name__ == "__main__":
    main()
