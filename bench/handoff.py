"""The 100-token handoff microbenchmark: ship those tokens' KV, or their IDs and recompute.

    python bench/handoff.py [--model tiny|DIR] [--trials 100] [--tokens 100]
        [--gbps 1] [--rtt-ms 20] [--jitter-ms 10] [--json OUT]

A relay has generated ``--tokens`` tokens after a prompt whose KV the main
decode already holds. Two ways to bring MD up to date, each measured over
``--trials`` trials through the same in-process WAN link emulator (bandwidth
cap, RTT, jitter):

* ``kv``: send those tokens' KV chunks over the link; MD imports them.
* ``ids``: send the token IDs (4 bytes each); MD recomputes their KV in one
  extend pass (``resume``) and samples the next token.

The clock runs from the first byte sent to MD being ready to decode. Setup
(MD holding the prompt's KV) is outside the clock. Reported: payload bytes,
mean, p50, max and std of the latency, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable

import torch

from pdd.wan.link import WanLink
from pdd.worker.engine import Engine
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.loader import load_model
from pdd.worker.transport import (
    Channel,
    MsgType,
    connect,
    decode_token_ids,
    encode_token_ids,
    serve,
)

SECRET = "bench-handoff"
PROMPT_TOKENS = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--gbps", type=float, default=1.0)
    p.add_argument("--rtt-ms", type=float, default=20.0)
    p.add_argument("--jitter-ms", type=float, default=10.0)
    p.add_argument("--json", help="write the results here as JSON")
    return p.parse_args(argv)


class Setup:
    """A relay engine that generated ``tokens`` after a prompt, and an MD engine."""

    def __init__(self, args: argparse.Namespace) -> None:
        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
        self.rld = Engine(loaded, num_blocks=256)
        self.md = Engine(loaded, num_blocks=256)
        rng = random.Random(0)
        vocab = min(loaded.config.vocab_size, 256)
        self.prompt = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
        params = SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True)
        self.rld.add_request(self.prompt, params, "src", hold_kv=True)
        out: list[int] = []
        while self.rld.has_unfinished():
            for o in self.rld.step():
                out.extend(o.new_token_ids)
        self.generated = out[: args.tokens]
        self.first = self.generated[0]
        n, t = len(self.prompt), args.tokens
        self.prompt_kv = list(self.rld.export_kv("src", 0, n))
        self.tokens_kv = list(self.rld.export_kv("src", n, n + t))

    def attach(self, token_ids: list[int]) -> None:
        """MD holds the prompt's KV (untimed), fresh for every trial."""
        self.md.reset_prefix_cache()
        self.md.attach_request(token_ids, SamplingParams(max_tokens=4096), "dst")
        for chunk in self.prompt_kv:
            self.md.import_kv("dst", chunk)

    def finish(self) -> None:
        self.md.abort("dst")


async def kv_trial(setup: Setup, channel: Channel, received: asyncio.Queue) -> tuple[float, int]:
    setup.attach(setup.prompt + setup.generated)
    start = time.perf_counter()
    for chunk in setup.tokens_kv:
        await channel.send(MsgType.KV_CHUNK, 1, chunk)
    for _ in setup.tokens_kv:
        await asyncio.to_thread(setup.md.import_kv, "dst", await received.get())
    elapsed = time.perf_counter() - start
    setup.finish()
    return elapsed, sum(len(c) for c in setup.tokens_kv)


async def ids_trial(setup: Setup, channel: Channel, received: asyncio.Queue) -> tuple[float, int]:
    setup.attach(setup.prompt)
    payload = encode_token_ids(0, setup.generated)
    start = time.perf_counter()
    await channel.send(MsgType.TOKEN_IDS, 1, payload)
    ids = decode_token_ids(await received.get()).ids

    def extend() -> None:
        setup.md.resume("dst", ids)
        setup.md.step()  # the one extend pass over every handed-over token

    await asyncio.to_thread(extend)
    elapsed = time.perf_counter() - start
    setup.finish()
    return elapsed, len(payload)


Trial = Callable[[Setup, Channel, asyncio.Queue], Awaitable[tuple[float, int]]]


def summarize(name: str, samples: list[float], payload: int) -> dict:
    ms = sorted(s * 1000 for s in samples)
    return {
        "method": name,
        "payload_bytes": payload,
        "trials": len(ms),
        "mean_ms": statistics.fmean(ms),
        "p50_ms": statistics.median(ms),
        "max_ms": ms[-1],
        "std_ms": statistics.pstdev(ms),
    }


async def run(args: argparse.Namespace) -> list[dict]:
    setup = Setup(args)
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def sink(channel: Channel) -> None:
        while True:
            frame = await channel.recv(timeout_s=None)
            if frame.msg_type == MsgType.CLOSE:
                return
            received.put_nowait(frame.payload)

    server = await serve("127.0.0.1", 0, SECRET, sink, name="md")
    link = WanLink(
        f"127.0.0.1:{0}", f"127.0.0.1:{server.port}", args.gbps, args.rtt_ms, args.jitter_ms,
        seed=0,
    )  # fmt: skip
    await link.start()
    channel = await connect("127.0.0.1", link.port, SECRET, "rld")
    results = []
    try:
        trials: dict[str, Trial] = {"kv": kv_trial, "ids+extend": ids_trial}
        for name, trial in trials.items():
            samples, payload = [], 0
            for _ in range(args.trials):
                elapsed, payload = await trial(setup, channel, received)
                samples.append(elapsed)
            results.append(summarize(name, samples, payload))
    finally:
        await channel.close()
        await link.stop()
        await server.close()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(2)
    results = asyncio.run(run(args))
    print(
        f"{args.tokens}-token handoff over {args.gbps} Gbit/s, RTT {args.rtt_ms} ms, "
        f"jitter {args.jitter_ms} ms, {args.trials} trials, model {args.model}"
    )
    print(
        f"{'method':<12}{'payload B':>12}{'mean ms':>10}{'p50 ms':>10}{'max ms':>10}{'std ms':>10}"
    )
    for r in results:
        print(
            f"{r['method']:<12}{r['payload_bytes']:>12}{r['mean_ms']:>10.2f}{r['p50_ms']:>10.2f}"
            f"{r['max_ms']:>10.2f}{r['std_ms']:>10.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
