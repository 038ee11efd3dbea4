"""What the policy knows of the WAN line, in one value: ``decide`` reads the line from
a ``LinkView`` alone.

The live router builds it from what it measured (``Dispatcher``: the link estimator's
goodput, backlog, prefill rates, relay slot and the P-MD path's fixed cost; the line's
health; the KV still crossing that a prompt's hit counts on; the prefill each MD is
computing). The simulator builds it
from its own estimator's view of the line (``pdd.simulator.cluster``): the fields it
leaves at their defaults are what it does not model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdd.common.cost_model import LinkState


@dataclass(frozen=True)
class LinkView:
    #: The line: declared rate and RTT, measured goodput, the KV committed to it.
    state: LinkState
    #: Why the line is not trusted now (a transfer over it failed lately:
    #: ``pdd.router.link_health``); None: it is.
    doubt: str | None = None
    #: Measured prefill tokens/s per P instance (the policy's configured rate for one
    #: not in it): how long P's miss takes, which the transfer races.
    prefill_rates: Mapping[str, float] = field(default_factory=dict)
    #: Seconds each request already on the relay adds to a relayed request's first
    #: token (the link estimator's ``relay_slot_s``; 0: none measured).
    relay_slot_s: float = 0.0
    #: Per MD, the KV still crossing to it that this prompt's hit there counts on (the
    #: link estimator's ``awaited_bytes``).
    awaited_bytes: Mapping[str, int] = field(default_factory=dict)
    #: Per MD, the prompt tokens it is computing for requests routed before (their first
    #: token not yet out: ``pdd.router.route.md_computing_tokens``); a miss MD computes
    #: queues behind them.
    md_computing_tokens: Mapping[str, int] = field(default_factory=dict)
    #: MD's first step as measured (the link estimator's fixed cost of the P-MD path);
    #: None: the policy's ``md_first_step_s``.
    md_step_s: float | None = None
