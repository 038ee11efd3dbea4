"""What the WAN link meters read through a real ``pdd wan-link`` line, against what it imposes.

    python bench/wan_meter.py [--link-gbps 0.08] [--link-rtt-ms 40] [--link-jitter-ms 0]
        [--seconds 15]
        [--window-s 10] [--json OUT]

Starts ``pdd wan-link`` as a process (rate, RTT, jitter), a transport server behind it
(MD's end: it consumes every frame) and a client in front (P's end), both metered as a
WAN link (``pdd.worker.transport.link_meter``) over loopback TCP. The client keeps the line busy
with 1 MiB KV frames for ``--seconds``, and once a second opens a short second channel,
as a new request would, whose handshake times the round trip *under load*; one more
probe before the transfer times it idle. Reported, each end: goodput over the window
against the line's rate and against what the line itself says it forwarded during that
window (its admin ``/stats``: the ground truth when the machine, not the line, is the
bottleneck), and the smoothed and the minimum RTT against the line's delay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdd.worker.transport import Channel, MsgType, TransportError, connect, serve
from pdd.worker.transport.link_meter import LinkKey, LinkMeters, LinkSnapshot
from pdd.worker.transport.metering import ChannelMeter

SECRET = "bench-wan-meter"
HOST = "127.0.0.1"
LINK = LinkKey("p-0", "md-0", "prefill", "main")
MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def meter(channel: Channel, links: LinkMeters, out: LinkKey, sends: bool) -> None:
    now = asyncio.get_running_loop().time()
    channel.attach_meter(ChannelMeter(links.meter(out, now), links.meter(out.reverse, now), sends))


def start_line(args: argparse.Namespace, listen: int, to: int, admin: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pdd.cli", "wan-link", f"--listen={HOST}:{listen}"]
    argv += [
        f"--to={HOST}:{to}",
        f"--link-gbps={args.link_gbps}",
        f"--link-rtt-ms={args.link_rtt_ms}",
    ]
    argv += [f"--link-jitter-ms={args.link_jitter_ms}", f"--admin={HOST}:{admin}", "--seed=0"]
    line = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://{HOST}:{admin}/stats").raise_for_status()
            return line
        except httpx.HTTPError:
            time.sleep(0.1)
    line.kill()
    raise SystemExit("pdd wan-link did not come up within 60 s")


async def measure(args: argparse.Namespace) -> dict:
    receiver, sender = LinkMeters(window_s=args.window_s), LinkMeters(window_s=args.window_s)

    async def consume(channel: Channel) -> None:
        meter(channel, receiver, LINK.reverse, sends=False)
        try:
            while (await channel.recv(timeout_s=None)).msg_type != MsgType.CLOSE:
                pass
        except TransportError:
            pass

    to, listen, admin = free_port(), free_port(), free_port()
    server = await serve(HOST, to, SECRET, consume, name="md-0")
    line = await asyncio.to_thread(start_line, args, listen, to, admin)
    http = httpx.AsyncClient(base_url=f"http://{HOST}:{admin}")
    loop = asyncio.get_running_loop()

    async def forwarded() -> tuple[float, int]:
        """(when, bytes the line has forwarded to MD); when: the middle of the request."""
        asked = loop.time()
        count = int((await http.get("/stats")).json()["forward"]["bytes"])
        return (asked + loop.time()) / 2, count

    try:

        async def probe() -> None:
            channel = await connect(HOST, listen, SECRET, "p-0")
            meter(channel, sender, LINK, sends=True)
            await channel.close()

        await probe()
        idle_rtt = sender.meter(LINK, loop.time()).snapshot(loop.time()).rtt_min_s
        channel = await connect(HOST, listen, SECRET, "p-0")
        meter(channel, sender, LINK, sends=True)
        start, chunk = loop.time(), bytes(MIB)
        next_probe = start + 1.0
        window_start: tuple[float, int] | None = None  # (time, bytes the line had forwarded)
        while loop.time() - start < args.seconds:
            await channel.send(MsgType.KV_CHUNK, 1, chunk)
            if window_start is None and loop.time() - start >= args.seconds - args.window_s:
                window_start = await forwarded()
            if loop.time() >= next_probe:
                next_probe += 1.0
                await probe()
        window_end = await forwarded()
        now = loop.time()
        sent, got = sender.meter(LINK, now).snapshot(now), receiver.meter(LINK, now).snapshot(now)
        await channel.close()
    finally:
        await http.aclose()
        line.terminate()
        line.wait(10)
        await server.close()
    assert window_start is not None, "--seconds must be at least --window-s"
    line_bps = (window_end[1] - window_start[1]) / (window_end[0] - window_start[0])
    return report(args, idle_rtt, line_bps, sent, got)


def view(snap: LinkSnapshot) -> dict:
    return {"goodput_bps": snap.goodput_bps, "rtt_s": snap.rtt_s, "rtt_min_s": snap.rtt_min_s}


def report(
    args: argparse.Namespace,
    idle_rtt: float | None,
    line_bps: float,
    sent: LinkSnapshot,
    got: LinkSnapshot,
) -> dict:
    return {
        "line": {
            "bytes_per_s": args.link_gbps * 1e9 / 8,
            "rtt_s": args.link_rtt_ms / 1000,
            "jitter_s": args.link_jitter_ms / 1000,
        },
        "line_forwarded_bps": line_bps,
        "window_s": args.window_s,
        "seconds": args.seconds,
        "loadavg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "idle_rtt_s": idle_rtt,
        "sender": view(sent),
        "receiver": view(got),
    }


def print_table(r: dict) -> None:
    line, forwarded = r["line"], r["line_forwarded_bps"]
    print(
        f"line: {line['bytes_per_s'] / 1e6:.2f} MB/s, RTT {line['rtt_s'] * 1e3:.1f} ms, "
        f"jitter {line['jitter_s'] * 1e3:.1f} ms; {r['seconds']} s busy, window {r['window_s']} s; "
        f"load {r['loadavg_1m']:.2f} on {r['cpus']} CPUs"
    )
    print(f"the line forwarded {forwarded / 1e6:.3f} MB/s over the last window")
    print(f"{'end':<10}{'goodput MB/s':>14}{'of rate':>9}{'of fwd':>8}{'SRTT ms':>10}{'min ms':>8}")
    for end in ("sender", "receiver"):
        e = r[end]
        goodput = e["goodput_bps"]
        print(
            f"{end:<10}{goodput / 1e6:>14.3f}{goodput / line['bytes_per_s']:>9.1%}"
            f"{goodput / forwarded:>8.1%}{e['rtt_s'] * 1e3:>10.2f}{e['rtt_min_s'] * 1e3:>8.2f}"
        )
    print(f"idle RTT (one probe before the transfer): {r['idle_rtt_s'] * 1e3:.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--link-gbps", type=float, default=0.08, help="line rate (0.08 = 10 MB/s)")
    p.add_argument("--link-rtt-ms", type=float, default=40.0)
    p.add_argument("--link-jitter-ms", type=float, default=0.0)
    p.add_argument("--seconds", type=float, default=15.0, help="how long the line stays busy")
    p.add_argument("--window-s", type=float, default=10.0, help="the goodput window")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args()
    result = asyncio.run(measure(args))
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
