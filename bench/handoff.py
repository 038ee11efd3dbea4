"""The 100-token handoff microbenchmark: ship those tokens' KV, or their IDs and recompute;
and what TLS on the WAN channels costs, side by side with plaintext in one run.

    python bench/handoff.py [--model tiny|DIR] [--trials 100] [--tokens 100]
        [--link-gbps 1] [--link-rtt-ms 20] [--link-jitter-ms 10] [--tls both|off|on]
        [--bulk-mib 256]
        [--json OUT]

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

Each runs with the WAN channel in plaintext and over TLS 1.3 (mutual, with a certificate
the operator's generator makes, as ``spec.wan.tls`` does). The emulated line hides TLS's
CPU cost behind its rate, so a second table sends ``--bulk-mib`` of KV chunks straight
over loopback (no line: the transport is the bottleneck) and reports throughput and the
process's CPU seconds per GiB (both ends are in this process: encryption and decryption).

A third table is the router's side of MD's control API (``HTTPS_ROLES``), served by
uvicorn as the worker serves it (plaintext, or TLS 1.3 with the worker's
``http_server`` context) and read with the router's ``WorkerClient`` trusting ``ca.crt``:
a new connection's first ``GET`` (TCP and, with TLS, the handshake; ``--http-trials``
of them) and a token stream of ``--stream-events`` NDJSON events (throughput and CPU
per 1,000 events, both ends in this process), over loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import ssl
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pdd.common.wan_tls import load_wan_ca
from pdd.common.wire import TokenEvent
from pdd.operator.builders.wan_tls import new_wan_tls
from pdd.router.worker_client import WorkerClient
from pdd.wan.link import WanLink
from pdd.worker.engine import Engine
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.loader import load_model
from pdd.worker.transport import (
    Channel,
    MsgType,
    WanTls,
    connect,
    decode_token_ids,
    encode_token_ids,
    load_wan_tls,
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
    p.add_argument("--link-gbps", type=float, default=1.0)
    p.add_argument("--link-rtt-ms", type=float, default=20.0)
    p.add_argument("--link-jitter-ms", type=float, default=10.0)
    p.add_argument("--tls", choices=("both", "off", "on"), default="both", help="WAN channel")
    p.add_argument("--bulk-mib", type=int, default=256, help="KV sent for the TLS cost table")
    p.add_argument("--http-trials", type=int, default=200, help="new connections, HTTP table")
    p.add_argument("--stream-events", type=int, default=20_000, help="token events streamed")
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


def summarize(name: str, tls: bool, samples: list[float], payload: int) -> dict:
    ms = sorted(s * 1000 for s in samples)
    return {
        "method": name,
        "tls": tls,
        "payload_bytes": payload,
        "trials": len(ms),
        "mean_ms": statistics.fmean(ms),
        "p50_ms": statistics.median(ms),
        "max_ms": ms[-1],
        "std_ms": statistics.pstdev(ms),
    }


def bench_tls() -> tuple[WanTls, ssl.SSLContext]:
    """The contexts a worker and the router load from a generated WAN TLS Secret."""
    material = new_wan_tls("bench")
    with tempfile.TemporaryDirectory() as folder:
        for name, pem in material.files().items():
            (Path(folder) / name).write_text(pem)
        return load_wan_tls(Path(folder)), load_wan_ca(Path(folder))


class Sink:
    """MD's end: each payload goes to a queue, or with ``expect`` bytes are only counted
    and ``arrived`` is set once that many came."""

    def __init__(self, expect: int = 0) -> None:
        self.received: asyncio.Queue[bytes] = asyncio.Queue()
        self.bytes = 0
        self.arrived = asyncio.Event()
        self.expect = expect

    async def __call__(self, channel: Channel) -> None:
        while True:
            frame = await channel.recv(timeout_s=None)
            if frame.msg_type == MsgType.CLOSE:
                return
            self.bytes += len(frame.payload)
            if self.expect:
                if self.bytes >= self.expect:
                    self.arrived.set()
            else:
                self.received.put_nowait(frame.payload)


async def run_handoffs(setup: Setup, args: argparse.Namespace, tls: WanTls | None) -> list[dict]:
    sink = Sink()
    server = await serve("127.0.0.1", 0, SECRET, sink, name="md", tls=tls.server if tls else None)
    link = WanLink(
        f"127.0.0.1:{0}", f"127.0.0.1:{server.port}",
        args.link_gbps, args.link_rtt_ms, args.link_jitter_ms,
        seed=0,
    )  # fmt: skip
    await link.start()
    channel = await connect("127.0.0.1", link.port, SECRET, "rld", tls=tls.client if tls else None)
    results = []
    try:
        trials: dict[str, Trial] = {"kv": kv_trial, "ids+extend": ids_trial}
        for name, trial in trials.items():
            samples, payload = [], 0
            for _ in range(args.trials):
                elapsed, payload = await trial(setup, channel, sink.received)
                samples.append(elapsed)
            results.append(summarize(name, tls is not None, samples, payload))
    finally:
        await channel.close()
        await link.stop()
        await server.close()
    return results


async def run_bulk(args: argparse.Namespace, tls: WanTls | None) -> dict:
    """``--bulk-mib`` of 1 MiB KV chunks over loopback: throughput and CPU per GiB."""
    chunk = os.urandom(1 << 20)
    sink = Sink(expect=args.bulk_mib * len(chunk))
    server = await serve("127.0.0.1", 0, SECRET, sink, name="md", tls=tls.server if tls else None)
    channel = await connect("127.0.0.1", server.port, SECRET, "p", tls=tls.client if tls else None)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.bulk_mib):
            await channel.send(MsgType.KV_CHUNK, 1, chunk)
        await sink.arrived.wait()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        await channel.close()
        await server.close()
    gib = sink.expect / 2**30
    return {
        "tls": tls is not None,
        "mib": args.bulk_mib,
        "seconds": wall,
        "mib_per_s": args.bulk_mib / wall,
        "cpu_s_per_gib": cpu / gib,
    }


def control_api(events: int) -> FastAPI:
    """MD's control API as far as the router's calls need: ``/health`` and a token stream
    of ``events`` NDJSON lines (the worker's framing: one event per line, chunked)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/pdd/requests/{request_id}/stream")
    async def stream(request_id: str) -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            for seq in range(events):
                event = TokenEvent(request_id=request_id, seq=seq, token_id=seq % 50_000,
                                   source="md", finished=seq == events - 1)  # fmt: skip
                yield event.model_dump_json().encode() + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


async def run_http(args: argparse.Namespace, tls: WanTls | None, ca: ssl.SSLContext | None) -> dict:
    """New connections' first GET, and one long token stream, plaintext or TLS 1.3."""
    ssl_factory = (lambda _config, _default: tls.http_server) if tls is not None else None
    config = uvicorn.Config(
        control_api(args.stream_events), host="127.0.0.1", port=0, log_level="warning",
        lifespan="off", ssl_context_factory=ssl_factory,
    )  # fmt: skip
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    verify = ca if ca is not None else True
    try:
        connects = []
        for _ in range(args.http_trials):
            async with httpx.AsyncClient(verify=verify) as fresh:
                t0 = time.perf_counter()
                (await fresh.get(f"{url}/health")).raise_for_status()
                connects.append((time.perf_counter() - t0) * 1000)
        client = WorkerClient(SECRET, tls=ca)
        wall, cpu = time.perf_counter(), time.process_time()
        received = sum([1 async for _ in client.stream(url, "bench")])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        await client.aclose()
    finally:
        server.should_exit = True
        await serving
    assert received == args.stream_events
    return {
        "tls": tls is not None,
        "connect_mean_ms": statistics.fmean(connects),
        "connect_p50_ms": statistics.median(connects),
        "events_per_s": received / wall,
        "cpu_ms_per_1000_events": cpu * 1000 / (received / 1000),
    }


async def run(args: argparse.Namespace) -> tuple[list[dict], list[dict], list[dict]]:
    setup = Setup(args)
    handoffs, bulk, http = [], [], []
    for tls_on in {"both": (False, True), "off": (False,), "on": (True,)}[args.tls]:
        tls, ca = bench_tls() if tls_on else (None, None)
        handoffs += await run_handoffs(setup, args, tls)
        bulk.append(await run_bulk(args, tls))
        http.append(await run_http(args, tls, ca))
    return handoffs, bulk, http


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(2)
    handoffs, bulk, http = asyncio.run(run(args))
    print(
        f"{args.tokens}-token handoff over {args.link_gbps} Gbit/s, RTT {args.link_rtt_ms} ms, "
        f"jitter {args.link_jitter_ms} ms, {args.trials} trials, model {args.model}"
    )
    print(
        f"{'method':<12}{'WAN':>6}{'payload B':>12}{'mean ms':>10}{'p50 ms':>10}{'max ms':>10}"
        f"{'std ms':>10}"
    )
    for r in sorted(handoffs, key=lambda r: (r["method"], r["tls"])):
        print(
            f"{r['method']:<12}{'TLS' if r['tls'] else 'plain':>6}{r['payload_bytes']:>12}"
            f"{r['mean_ms']:>10.2f}{r['p50_ms']:>10.2f}{r['max_ms']:>10.2f}{r['std_ms']:>10.2f}"
        )
    print(f"\nKV transfer, {args.bulk_mib} MiB in 1 MiB chunks over loopback (no line)")
    print(f"{'WAN':<6}{'seconds':>10}{'MiB/s':>10}{'CPU s/GiB':>12}")
    for b in bulk:
        print(
            f"{'TLS' if b['tls'] else 'plain':<6}{b['seconds']:>10.2f}{b['mib_per_s']:>10.0f}"
            f"{b['cpu_s_per_gib']:>12.2f}"
        )
    print(
        f"\nMD's control API over loopback: {args.http_trials} new connections' first GET, "
        f"one stream of {args.stream_events} token events (router's WorkerClient)"
    )
    print(f"{'HTTP':<6}{'conn mean ms':>14}{'conn p50 ms':>13}{'events/s':>10}{'CPU ms/1k ev':>14}")
    for h in http:
        print(
            f"{'TLS' if h['tls'] else 'plain':<6}{h['connect_mean_ms']:>14.2f}"
            f"{h['connect_p50_ms']:>13.2f}{h['events_per_s']:>10.0f}"
            f"{h['cpu_ms_per_1000_events']:>14.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            out = {"config": vars(args), "results": handoffs, "bulk": bulk, "http": http}
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
