"""Which processes each mode runs, and the router's command line: pure builders.

| mode   | cluster A            | cluster B           | WAN link emulator         | router  |
| ------ | -------------------- | ------------------- | ------------------------- | ------- |
| pdd    | P, RLD               | MD                  | in front of MD and RLD    | policy  |
| naive  | P                    | MD                  | in front of MD            | naive   |
| samedc | P, MD                | -                   | none (fast path only)     | naive   |
| mono   | colocated workers    | -                   | none                      | mono    |

"naive" is cross-datacenter PD without PDD: P ships the full KV over the WAN, no
decode-side cache match. "samedc" is the same pipeline with MD next to P. RLD gets a
link too in pdd mode because MD's "KV complete" and RLD's token-ID handoff cross the WAN.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pdd.local.cluster import LinkSpec, WorkerSpec

Mode = Literal["pdd", "naive", "samedc", "mono"]
MODES: tuple[Mode, ...] = ("mono", "samedc", "naive", "pdd")

#: The router flags that make it plan the naive pipeline (full KV, no DRC match).
NAIVE_ROUTER_FLAGS: tuple[str, ...] = ("--force-pipeline", "naive")


#: The emulated WAN line's defaults, sized for the tiny model: its KV is 2 KiB per token,
#: so a few thousand prompt tokens per second are tens of Mbit/s of KV, and a 50 Mbit/s
#: line makes full-KV shipping the bottleneck, as a 10-100 Gbit/s line is for a large model.
DEFAULT_LINK = LinkSpec(gbps=0.05, rtt_ms=30.0, jitter_ms=5.0)


class TopologyError(ValueError):
    """An inconsistent ``pdd up`` configuration; the message says what to change."""


@dataclass(frozen=True)
class Counts:
    prefill: int = 1
    relay: int = 1
    main: int = 1
    mono: int = 1

    def __post_init__(self) -> None:
        for name in ("prefill", "relay", "main", "mono"):
            if getattr(self, name) < 1:
                raise TopologyError(f"--{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class StackConfig:
    mode: Mode = "pdd"
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 8080
    counts: Counts = Counts()
    link: LinkSpec = DEFAULT_LINK
    redis_url: str | None = None
    log_dir: Path = Path("pdd-logs")
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    ready_timeout_s: float = 180.0
    served_model_name: str | None = None
    #: The TTFT the router's P-MD path must meet; None keeps the router's default.
    ttft_budget_s: float | None = None

    @property
    def served_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def worker_specs(mode: Mode, counts: Counts) -> list[WorkerSpec]:
    """The workers of one mode, named by role and index (``p0``, ``rld0``, ``md0``)."""
    if mode == "mono":
        return [WorkerSpec(f"mono{i}", "mono") for i in range(counts.mono)]
    remote = mode != "samedc"
    specs = [WorkerSpec(f"p{i}", "prefill") for i in range(counts.prefill)]
    if mode == "pdd":
        specs += [WorkerSpec(f"rld{i}", "relay", wan_facing=True) for i in range(counts.relay)]
    specs += [WorkerSpec(f"md{i}", "main", wan_facing=remote) for i in range(counts.main)]
    return specs


def router_argv(config: StackConfig, workers: list[tuple[str, str, str]]) -> list[str]:
    """``pdd router`` arguments for ``workers`` given as (name, role, http_url)."""
    argv = ["router", "--model", config.model, "--host", config.host, "--port", str(config.port)]
    if config.served_model_name:
        argv += ["--served-model-name", config.served_model_name]
    for name, role, url in workers:
        argv += [f"--{role}", f"{name}={url}"]
    if config.mode in ("pdd", "naive"):
        argv += ["--link-gbps", f"{config.link.gbps:g}", "--link-rtt-ms", f"{config.link.rtt_ms:g}"]
    if config.mode in ("naive", "samedc"):
        argv += list(NAIVE_ROUTER_FLAGS)
    if config.ttft_budget_s is not None:
        argv += ["--ttft-budget-s", f"{config.ttft_budget_s:g}"]
    if config.redis_url:
        argv += ["--redis", config.redis_url]
    return argv + list(config.router_args)
