"""Where one request goes and why: a ``Route``, what it counts in flight on its
instances and on the WAN line, and the plan the entry instance receives.

A route whose KV crosses the link counts under ``WAN_TRANSFERS`` (and its KiB under
``WAN_BACKLOG_KIB``) beside its instances, in the store every router replica shares,
until MD has the KV (``pdd.router.lease``): so each replica's policy sees the backlog
all of them committed (``committed_backlog``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from pdd.common.kv_codec import ADAPTIVE, KVCodec, shared_in_receiver_cache
from pdd.common.link_estimator import Backlog
from pdd.common.vocabulary import Pipeline
from pdd.common.wire import Endpoint, PipelinePlan, SamplingSpec
from pdd.router.config import RouterConfig

#: The in-flight counter of KV transfers on the WAN link, beside the instances' counters:
#: every replica adds its own, so all of them see the line's load (no instance has this id).
WAN_TRANSFERS = "~wan-transfers"
#: ... and of the KiB of KV those transfers carry (the store counts integers).
WAN_BACKLOG_KIB = "~wan-backlog-kib"
_KIB = 1024
#: Per MD, the prompt tokens it was asked to compute itself and has not yet answered
#: with a token: the prefill queued on it, which a further request computed there waits
#: behind (``md_computing_key``, ``md_computing_tokens``).
_MD_COMPUTING = "~md-computing-tokens:"


#: Per MD, the requests routed to it that have not reached it yet (no first token: they
#: wait in P's queue or prefill). They weigh in MD's choice, not in its saturation
#: (``md_pending_key``, ``InstanceLoad.pending``); at the first token each moves to MD's
#: own count (``Lease.main_reached``).
_MD_PENDING = "~md-pending:"


def md_pending_key(main_id: str) -> str:
    """The in-flight counter of the requests routed to MD ``main_id`` and not yet at it."""
    return f"{_MD_PENDING}{main_id}"


def pending_main(key: str) -> str | None:
    """The MD whose pending counter ``key`` is; None for any other counter."""
    return key[len(_MD_PENDING) :] if key.startswith(_MD_PENDING) else None


def md_computing_key(main_id: str) -> str:
    """The in-flight counter of the tokens MD ``main_id`` is computing."""
    return f"{_MD_COMPUTING}{main_id}"


def md_computing_tokens(inflight: Mapping[str, int]) -> Mapping[str, int]:
    """Per MD, the tokens every replica's routes have it computing (from the store's
    in-flight counts), read per MD when asked."""
    return _MdComputing(inflight)


class _MdComputing(Mapping[str, int]):
    """The in-flight counts seen per MD: the policy asks only about the MD it chose, and
    building the whole map would walk every busy instance's count per request."""

    def __init__(self, inflight: Mapping[str, int]) -> None:
        self._inflight = inflight

    def __getitem__(self, main_id: str) -> int:
        tokens = self._inflight.get(md_computing_key(main_id), 0)
        if tokens <= 0:
            raise KeyError(main_id)
        return tokens

    def __iter__(self) -> Iterator[str]:
        n = len(_MD_COMPUTING)
        return (k[n:] for k, v in self._inflight.items() if k.startswith(_MD_COMPUTING) and v > 0)

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass(frozen=True)
class Route:
    """Where one request goes and why (``reason`` for people, ``reason_code`` for metrics)."""

    pipeline: Pipeline
    reason: str
    reason_code: str
    prefill: Endpoint | None
    relay: Endpoint | None
    main: Endpoint | None
    p_hit_tokens: int = 0
    md_hit_tokens: int = 0
    #: The prompt's chained block hashes, computed once for the lookup and reused when
    #: MD reports its real hit (``MeasuredHits``).
    prompt_hashes: tuple[int, ...] = ()
    #: ``LinkHealth.ticket`` when this route was chosen: its KV landing on MD proves the
    #: line only if no transfer failed since.
    link_ticket: int = 0
    #: KV bytes P ships to MD over the link (MD's miss; 0 when nothing crosses).
    kv_bytes: int = 0
    #: Tokens P computes (its miss): what the link estimator's samples take P's time from.
    prefill_tokens: int = 0
    #: The line's backlog (every replica's) when this route was chosen.
    backlog: Backlog = field(default_factory=Backlog)
    #: Requests already on the relay when this route was chosen: the link estimator
    #: reads the relay's first token as P's time only when there were none.
    relay_active: int = 0
    #: The hashes of the prompt blocks P ships into MD's cache (past MD's hit): a later
    #: request counting on them waits for this transfer (``LinkEstimator.awaited_bytes``).
    carried_hashes: tuple[int, ...] = ()
    #: The codec the router chose for MD's KV (``spec.wan.kvCodec: adaptive``) and its
    #: KV bytes per token on the WAN; None: the deployment's codec.
    kv_codec: KVCodec | None = None
    kv_bytes_per_token: int | None = None
    #: MD computes its miss from the prompt's IDs (adaptive): no KV crosses the line.
    md_computes_miss: bool = False
    #: The tokens MD computes where it does (its miss), counted against it until its
    #: first token (``md_computing_key``).
    md_compute_tokens: int = 0

    @property
    def endpoints(self) -> list[Endpoint]:
        return [e for e in (self.prefill, self.relay, self.main) if e is not None]

    @property
    def ships_kv(self) -> bool:
        """P sends the prompt's KV (MD's miss) to MD: a transfer on the link."""
        return self.prefill is not None and self.main is not None

    @property
    def fills_main_cache(self) -> bool:
        """MD keeps what P ships in its prefix cache (naive bypasses it, and under adaptive
        KV coded lossily stays the request's own: ``shared_in_receiver_cache``)."""
        shared = self.kv_codec is None or shared_in_receiver_cache(self.kv_codec, ADAPTIVE)
        return self.ships_kv and self.pipeline != Pipeline.NAIVE and shared

    @property
    def loads_line(self) -> bool:
        """KV crosses the line (not where MD computes its miss): a transfer the line's
        backlog and the link estimator count."""
        return self.ships_kv and not self.md_computes_miss

    @property
    def computing_key(self) -> str | None:
        """The counter of MD's computing this route adds to, None where MD computes nothing."""
        if not self.md_computes_miss or self.md_compute_tokens == 0 or self.main is None:
            return None
        return md_computing_key(self.main.instance_id)

    @property
    def main_waits_upstream(self) -> bool:
        """P serves the request before MD does: until its first token it waits in P's
        queue or prefill, and MD (which learns of it only when P ships its KV) runs
        nothing of it, so it counts as pending there (``md_pending_key``). Not where MD
        prefills on P-MD: P hands it over at once (``PipelinePlan.md_prefills``)."""
        md_prefills = self.md_computes_miss and self.pipeline == Pipeline.P_MD
        return self.prefill is not None and self.main is not None and not md_prefills

    @property
    def lease_keys(self) -> list[str]:
        """What this route counts in flight: its instances (MD as pending where P serves
        first), the link when it ships KV, and MD's computing where MD computes its miss."""
        keys = [e.instance_id for e in self.endpoints]
        if self.main_waits_upstream:
            assert self.main is not None
            keys[keys.index(self.main.instance_id)] = md_pending_key(self.main.instance_id)
        if self.loads_line:
            keys += [WAN_TRANSFERS, WAN_BACKLOG_KIB]
        return keys if self.computing_key is None else [*keys, self.computing_key]

    @property
    def lease_amounts(self) -> dict[str, int]:
        """Counts other than 1 a lease holds: the KiB of KV this route commits to the line,
        the tokens it has MD compute."""
        amounts = {WAN_BACKLOG_KIB: math.ceil(self.kv_bytes / _KIB)} if self.loads_line else {}
        if self.computing_key is not None:
            amounts[self.computing_key] = self.md_compute_tokens
        return amounts

    def plan(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        config: RouterConfig,
    ) -> PipelinePlan:
        return PipelinePlan(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampling=sampling,
            pipeline=self.pipeline,
            prefill=self.prefill,
            relay=self.relay,
            main=self.main,
            handoff=config.handoff,
            catchup_threshold=config.catchup_threshold,
            main_hit_tokens=self.md_hit_tokens if self.ships_kv else None,
            kv_codec=self.kv_codec if self.ships_kv else None,
            md_computes_miss=self.md_computes_miss and self.ships_kv,
        )


def committed_backlog(inflight: Mapping[str, int]) -> Backlog:
    """The line's backlog as every replica's leases count it in the shared store."""
    return Backlog(inflight.get(WAN_BACKLOG_KIB, 0) * _KIB, inflight.get(WAN_TRANSFERS, 0))
