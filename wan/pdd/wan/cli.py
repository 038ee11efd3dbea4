"""``pdd wan-link``: run one emulated WAN line (``WanLink``) with its admin endpoint.

    pdd wan-link --listen 127.0.0.1:7100 --to 127.0.0.1:7000 \\
        --link-gbps 10 --link-rtt-ms 30 --link-jitter-ms 5 --admin 127.0.0.1:7101

More routes can share the line: ``--route LISTEN=TO`` (repeatable), e.g. one per
address of the far side that the near side dials. The line itself is ``pdd.wan.link``;
the admin HTTP endpoint that re-rates or cuts it at run time is ``pdd.wan.admin``.
See docs/wan-link.md.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from pdd.common.gc_heap import freeze_startup_heap
from pdd.common.logs import add_log_flags, configure_logging
from pdd.common.settings import parser as settings_parser
from pdd.common.wan_line import WanLine, add_line_flags, parsed_line
from pdd.wan.admin import AdminServer
from pdd.wan.link import Route, WanLink


def build_parser() -> argparse.ArgumentParser:
    parser = settings_parser("pdd wan-link", "TCP proxy emulating one shared WAN line")
    parser.add_argument("--listen", required=True, help="host:port to accept connections on")
    parser.add_argument("--to", required=True, help="host:port to forward them to")
    parser.add_argument(
        "--route", action="append", default=[], metavar="LISTEN=TO",
        help="another forwarded address sharing the same line (repeatable)",
    )  # fmt: skip
    parser.add_argument("--admin", help="host:port for the admin HTTP endpoint (default: none)")
    # The line's settings (``WanLine``), the flags ``pdd up`` and ``pdd router`` have too.
    add_line_flags(parser)
    add_log_flags(parser)
    parser.add_argument(
        "--seed", type=int, help="seed the jitter for reproducible runs (default: random)"
    )
    return parser


async def _run(args: argparse.Namespace) -> None:
    line = parsed_line(args, WanLine)
    link = WanLink(
        args.listen,
        args.to,
        line.gbps,
        line.rtt_ms,
        line.jitter_ms,
        partition_grace_s=line.partition_grace_s,
        seed=args.seed,
        extra_routes=[Route.parse(r) for r in args.route],
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await link.start()
    admin = AdminServer(link) if args.admin else None
    if admin is not None:
        await admin.start(args.admin)
    freeze_startup_heap()  # the line's own objects are few; its libraries' are not
    more = f" and {len(args.route)} more routes" if args.route else ""
    print(
        f"wan-link listening on {args.listen} -> {args.to}{more} ({line.gbps} Gbit/s)",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        if admin is not None:
            await admin.close()
        await link.stop()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        asyncio.run(_run(args))
    except ValueError as exc:
        print(f"pdd wan-link: {exc}", file=sys.stderr)
        return 2
    return 0
