"""The words every component shares: a worker's role and a request's pipeline.

Defined once here (the wire schemas, the router, the simulator and the operator
import them) so a new role or pipeline cannot be spelled differently in two places.
Both are string enums: they compare equal to, and serialize as, their values.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class Role(StrEnum):
    """What a worker instance does (``pdd worker --role``)."""

    PREFILL = "prefill"  # P: computes the prompt's KV (datacenter A)
    RELAY = "relay"  # RLD: decodes while P's KV crosses the WAN (datacenter A)
    MAIN = "main"  # MD: the main decode tier with its decode-side cache (datacenter B)
    MONO = "mono"  # one instance does everything (no disaggregation; local baseline)


#: The roles a disaggregated (PDD) deployment runs; mono is the single-instance baseline.
PDD_ROLES: tuple[Role, ...] = (Role.PREFILL, Role.RELAY, Role.MAIN)


def datacenter(component: str) -> str:
    """The datacenter a component runs in (a trace's ``pdd.datacenter``): MD in B; the
    router, P, the relays (and mono, the single-instance baseline) in A."""
    return "B" if component == Role.MAIN else "A"


class Pipeline(StrEnum):
    """The instances one request visits, in order."""

    P_RLD_MD = "P-RLD-MD"  # relay decodes until MD holds the KV, then hands off
    P_MD = "P-MD"  # MD's miss crosses the WAN within the TTFT budget
    P_RLD = "P-RLD"  # anomalous traffic: the relay decodes to the end
    MONO = "mono"
    NAIVE = "naive"  # the baseline: P ships the full KV to MD, no decode-side cache


class LinkFault(StrEnum):
    """How a KV transfer across the WAN failed, as the sender (P) saw it: what the router's
    link health (``pdd.router.link_health``) makes of the line."""

    UNREACHABLE = "unreachable"  # refused, reset, or no answer to the handshake: a cut
    STALLED = "stalled"  # connected, then the bytes stopped moving within the timeout


#: Why a generation ended, in OpenAI's words: a stop (EOS, stop token or string), the
#: token limit, or an abort. The worker's stream events and the API responses share it.
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ToolCallFormat(StrEnum):
    """How a model writes a tool call in its output text (its chat template's convention):
    what the router's tool-call parser reads and what a forced tool call's grammar allows."""

    # Hermes / Qwen2 / Qwen3: <tool_call>{"name": .., "arguments": {..}}</tool_call>
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"  # Llama 3.x: a bare {"name": .., "parameters": {..}} object


#: The gauge each relay pod exports and its HPA scales on (through a custom-metrics
#: adapter): the worker's metric, the operator's HPA and the chart's adapter rule.
RELAY_LOAD_METRIC = "pdd_worker_relay_load"

#: The Kubernetes label naming a pod's component (prefill, relay, main, router, redis):
#: the operator puts it on what it renders, ``pdd up`` reads it back from the same objects.
COMPONENT_LABEL = "app.kubernetes.io/component"
