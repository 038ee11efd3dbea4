"""Kernel shaping: the line rate enforced by a ``tbf`` qdisc on a veth pair.

The second backend beside the user-space ``WanLink``. A network namespace
holds one end of a veth pair; a token-bucket filter on each end's egress caps
the rate in both directions, so anything run inside the namespace (``exec_argv``)
sits behind a real kernel bottleneck shared by all its connections. It needs
root (``ip netns``); netem is not available here, so this backend shapes rate
only: use ``WanLink`` when RTT and jitter matter, or chain the two.

Commands are built by pure functions (testable anywhere) and run by
``ShapedLink``, which always tears down what it set up.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass


class KernelShapingError(RuntimeError):
    """A setup command failed: usually not root, or no netns/tbf support in this kernel."""


@dataclass(frozen=True)
class ShapedLinkSpec:
    """One namespace behind one shaped veth pair, on subnet 10.233.<index>.0/30."""

    name: str
    index: int
    gbps: float
    latency_ms: float = 50.0  # how long tbf may queue a packet before dropping it

    def __post_init__(self) -> None:
        if not 0 <= self.index <= 255:
            raise ValueError(f"index {self.index} must be in 0..255 (third octet of 10.233.x.0)")
        if len(self.name) > 11 or not self.name.isalnum():
            raise ValueError(f"name {self.name!r} must be alphanumeric, at most 11 chars")
        if self.gbps <= 0:
            raise ValueError(f"rate must be positive, got {self.gbps} Gbit/s")

    @property
    def namespace(self) -> str:
        return f"pdd-{self.name}"

    @property
    def host_dev(self) -> str:  # interface names are limited to 15 characters
        return f"{self.name}h"

    @property
    def ns_dev(self) -> str:
        return f"{self.name}n"

    @property
    def host_ip(self) -> str:
        return f"10.233.{self.index}.1"

    @property
    def ns_ip(self) -> str:
        """The address of the far (shaped) side, reachable from the host."""
        return f"10.233.{self.index}.2"


def _tbf(gbps: float, latency_ms: float) -> list[str]:
    bits = int(gbps * 1e9)
    # The bucket must hold at least one GSO super-packet (64 KiB) and a few ms of line time.
    burst = max(128 * 1024, bits // 8 // 200)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", f"{latency_ms}ms"]


def setup_commands(spec: ShapedLinkSpec) -> list[list[str]]:
    ns, host, peer = spec.namespace, spec.host_dev, spec.ns_dev
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host, "type", "veth", "peer", "name", peer],
        ["ip", "link", "set", peer, "netns", ns],
        ["ip", "addr", "add", f"{spec.host_ip}/30", "dev", host],
        ["ip", "link", "set", host, "up"],
        ["ip", "-n", ns, "addr", "add", f"{spec.ns_ip}/30", "dev", peer],
        ["ip", "-n", ns, "link", "set", peer, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        *rate_commands(spec, spec.gbps, verb="add"),
    ]


def rate_commands(spec: ShapedLinkSpec, gbps: float, verb: str = "replace") -> list[list[str]]:
    """Shape both directions: host egress (towards the namespace) and namespace egress."""
    tbf = _tbf(gbps, spec.latency_ms)
    return [
        ["tc", "qdisc", verb, "dev", spec.host_dev, "root", *tbf],
        ["tc", "-n", spec.namespace, "qdisc", verb, "dev", spec.ns_dev, "root", *tbf],
    ]


def stats_commands(spec: ShapedLinkSpec) -> list[list[str]]:
    """The qdisc of each direction, with its counters, as JSON (host egress first)."""
    return [
        ["tc", "-s", "-j", "qdisc", "show", "dev", spec.host_dev],
        ["tc", "-n", spec.namespace, "-s", "-j", "qdisc", "show", "dev", spec.ns_dev],
    ]


@dataclass(frozen=True)
class QdiscStats:
    """What the kernel's token bucket on one direction reports."""

    rate_bytes_per_s: int
    bytes: int
    overlimits: int  # packets the bucket held back: the rate limit engaged
    drops: int


def parse_qdisc_stats(text: str) -> QdiscStats:
    """``tc -s -j qdisc show`` output (one tbf root) -> its counters."""
    [qdisc] = [q for q in json.loads(text) if q.get("kind") == "tbf"]
    return QdiscStats(
        rate_bytes_per_s=int(qdisc["options"]["rate"]),
        bytes=int(qdisc["bytes"]),
        overlimits=int(qdisc["overlimits"]),
        drops=int(qdisc["drops"]),
    )


def teardown_commands(spec: ShapedLinkSpec) -> list[list[str]]:
    # Deleting the namespace deletes its veth end, which deletes the pair.
    return [["ip", "link", "del", spec.host_dev], ["ip", "netns", "del", spec.namespace]]


def _run(argv: list[str]) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise KernelShapingError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result.stdout


class ShapedLink:
    """Context manager: set the namespace and qdiscs up, tear them down on exit."""

    def __init__(self, spec: ShapedLinkSpec) -> None:
        self.spec = spec

    def __enter__(self) -> ShapedLink:
        try:
            for argv in setup_commands(self.spec):
                _run(argv)
        except (KernelShapingError, OSError) as exc:
            self.close()
            raise KernelShapingError(f"kernel shaping unavailable: {exc}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_rate(self, gbps: float) -> None:
        for argv in rate_commands(self.spec, gbps):
            _run(argv)

    def stats(self) -> tuple[QdiscStats, QdiscStats]:
        """(towards the namespace, from the namespace): the kernel's own counters."""
        forward, reverse = (parse_qdisc_stats(_run(argv)) for argv in stats_commands(self.spec))
        return forward, reverse

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside the shaped namespace."""
        return ["ip", "netns", "exec", self.spec.namespace, *argv]

    def close(self) -> None:
        for argv in teardown_commands(self.spec):
            subprocess.run(argv, capture_output=True, check=False)  # best effort
