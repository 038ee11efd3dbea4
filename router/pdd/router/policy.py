"""The pipeline policy: which of P-MD, P-RLD-MD, P-RLD serves a request, and on whom.

A pure function of what the router knows at admission: the request's size, the
prefix index's hit estimates, the instances' load (a :class:`Fleet`, only read), the
WAN link's state and the recent share of relay-only traffic. Same inputs, same
decision; no clock, no I/O.

The rules, in order (the technique's "only two pipelines, plus one filter"):

1. **P-MD** when the first token can come from MD in time: ``pmd_first_token_seconds``
   (one RTT + the longer of P's prefill of its miss and the serialization of MD's miss,
   since P streams KV while it prefills, + MD's first step) ``<= ttft_budget_s``, on the
   live view of the line (``pdd.common.link_estimator``: measured goodput, the KV
   already queued on it, all of an earlier transfer still crossing to MD that the
   request's hit counts on), P's measured prefill throughput and the P-MD path's
   measured fixed cost (MD's step). Except where a relay sits **idle** and MD's first
   token would come at least ``idle_relay_min_transfer_s`` after the prefill ends: then
   P-RLD-MD, since the relay's first token does not wait for the transfer and the relay
   would otherwise do nothing. A relay holding any request is not idle, so under load
   this never takes relay capacity that a request over budget needs; at light load it
   keeps the tail of new conversations (their whole KV crosses) near same-datacenter
   PD's.
2. **P-RLD** for anomalous traffic only (input >= ``anomalous_min_input_tokens`` and a
   declared output below ``anomalous_output_tokens_below``) whose transfer does not
   fit, while relay-only traffic stays under its caps (share of recent requests and
   input tokens/s), so it can never absorb normal traffic.
3. **P-RLD-MD** when the transfer does not fit, a relay has room and the relay's own
   queue costs its first token less than the transfer costs MD's. The relay hides what
   MD's first token waits for after the prefill (one RTT and the serialization the
   prefill did not cover), not the prefill (both paths wait for that), so relaying pays
   only while the relay's queue is shorter than that; past that it would only load the
   relay further (``relay_slot_s``, measured by the link estimator).
4. **P-MD** anyway when every relay is saturated, saying so in the reason.

Where P-MD serves, **MD computes its miss** itself from the prompt's IDs when the miss
is at most ``md_recompute_max_tokens`` and that is sooner than the exact KV's crossing
(the line, not P's prefill, sets the exact KV's pace): P computes nothing and nothing
but the request crosses (``PipelinePlan.md_prefills``; Dynamo calls prefilling on the
decode worker conditional disaggregation). It is lossless, so under any codec. The
pipeline is still chosen on the exact KV's estimate, so an idle relay keeps the new
conversations whose KV would lag, and a request over budget is relayed as before.

A **retry** (the router recovering a request a worker failed) keeps a relay on the
route whenever one has room: P-RLD-MD, or P-RLD where no MD is left to choose. The
failure may be the WAN line or MD itself, and a relay in datacenter A carries the
request through either; the rules above assume both work.

Under ``spec.wan.kvCodec: adaptive`` the pipeline is chosen on the **exact** KV's
estimate, as with no codec: a transfer that fits goes P-MD exact, one that does not is
relayed with the exact KV (the relay's first token does not wait for the line, so coding
would only cost precision), unless the line is congested (its backlog takes longer than
the budget to drain): a relayed KV still crosses and every later transfer queues behind
it, so there it is coded as a P-MD one would be. A codec is also chosen where P-MD
serves although its exact KV misses the budget (every relay saturated, the relay's queue
longer than the transfer it would hide, no relay for a doubted line): MD computing its
miss from the prompt's IDs where that fits and the miss is at most
``md_recompute_max_tokens`` (lossless), else the least lossy of ``adaptive_codecs``
whose MD first token fits, int4 only where int8 does not, the soonest where none does
(int4, the smallest, or MD computing). Coding to fit instead
of relaying would put first tokens a hair under the budget at an estimate of the line
that lags a throttle by seconds, so they overran it; and it would code requests on a
healthy line, whose lossy KV then deviates from an exact run.

A **doubted line** (``LinkView.doubt``: a transfer over it failed lately, see
``pdd.router.link_health``) turns rule 1's P-MD into P-RLD-MD where a relay has room:
the relay serves if the KV cannot cross, and the KV that does cross proves the line.

No available P (or no available MD when the request must end at MD) is a typed
:class:`Saturated` result the server turns into 429 with Retry-After.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pdd.common.block_hash import ROOT_HASH, hash_block
from pdd.common.cost_model import (
    LinkState,
    backlog_drain_seconds,
    pmd_first_token_seconds,
    wan_transfer_seconds,
)
from pdd.common.kv_codec import MD_RECOMPUTE_MAX_TOKENS, KVCodec
from pdd.common.vocabulary import Pipeline
from pdd.router.fleet import Fleet
from pdd.router.instance_choice import (
    ChoiceWeights,
    InstanceLoad,
    choose_main_decode,
    choose_prefill,
    choose_relay,
)
from pdd.router.link_view import LinkView
from pdd.router.recent_traffic import TrafficWindow


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the policy; defaults follow the technique's figures."""

    kv_bytes_per_token: int
    #: ``spec.wan.kvCodec: adaptive``: the codecs the router chooses from per request,
    #: least lossy first, each with its KV bytes per token on the WAN (it takes the first
    #: whose MD first token fits the budget, the last where none does); (): one codec for
    #: every request, at ``kv_bytes_per_token``.
    adaptive_codecs: tuple[tuple[KVCodec, int], ...] = ()
    #: Time-to-first-token budget the P-MD path must meet (the SLO).
    ttft_budget_s: float = 2.0
    #: P's prefill throughput, to estimate how long P's miss takes to compute: the prior,
    #: where ``decide`` has no measured rate for the chosen P.
    prefill_tokens_per_s: float = 10_000.0
    #: Anomalous traffic: at least this much input ...
    anomalous_min_input_tokens: int = 32_000
    #: ... and a declared output shorter than this (the technique: under 500 tokens).
    anomalous_output_tokens_below: int = 500
    #: P-RLD may take at most this share of recent requests (the technique: 3-4% are
    #: anomalous; the cap sits just above so normal traffic can never flow there).
    relay_only_max_share: float = 0.05
    #: ... and at most this many input tokens/s; None leaves only the share cap.
    relay_only_max_tokens_per_s: float | None = None
    #: Seconds a client should wait before retrying a saturated router.
    retry_after_s: float = 1.0
    #: An idle relay takes a request that fits the budget when MD's first token would
    #: come at least this long after the prefill (rule 1); None: only requests over
    #: budget relay.
    idle_relay_min_transfer_s: float | None = 0.05
    #: MD's first step in the P-MD estimate where nothing measured it (the router's link
    #: estimator learns the path's fixed cost; the simulator charges its decode step).
    md_first_step_s: float = 0.0
    #: Under adaptive, MD may compute up to this many prompt tokens itself, from their
    #: IDs, where the exact KV's transfer misses the budget and that is sooner than any
    #: codec's (nothing but the first token crosses, and nothing is lost); 0: never. It
    #: bounds the prefill a decode instance takes on beside its batch.
    md_recompute_max_tokens: int = MD_RECOMPUTE_MAX_TOKENS
    #: MD's prefill throughput for that estimate; None: the chosen P's (the same model,
    #: on hardware that may prefill slower: set it where MD's is known).
    md_prefill_tokens_per_s: float | None = None
    weights: ChoiceWeights = field(default_factory=ChoiceWeights)

    @classmethod
    def default_of(cls, knob: str) -> Any:
        """A knob's default, for tools that expose the knobs (the simulator's scenarios)."""
        return next(f.default for f in fields(cls) if f.name == knob)

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be positive, got {self.kv_bytes_per_token}")
        if self.ttft_budget_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("ttft_budget_s and prefill_tokens_per_s must be positive")
        if self.md_recompute_max_tokens < 0:
            raise ValueError(
                f"md_recompute_max_tokens must be >= 0, got {self.md_recompute_max_tokens}"
            )
        if not 0.0 <= self.relay_only_max_share <= 1.0:
            raise ValueError(
                f"relay_only_max_share must be in [0, 1], got {self.relay_only_max_share}"
            )


@dataclass(frozen=True)
class RequestFeatures:
    input_tokens: int
    #: The request's max_tokens; None (no limit declared) is never anomalous.
    expected_output_tokens: int | None
    #: Rendezvous key for MD affinity: the conversation's first block hash.
    affinity_key: int

    @classmethod
    def from_prompt(
        cls, token_ids: Sequence[int], expected_output_tokens: int | None, block_size: int
    ) -> RequestFeatures:
        """Features of a tokenized prompt; a prompt shorter than one block is keyed by
        the hash of what it has, so it still lands somewhere deterministic."""
        key = hash_block(ROOT_HASH, token_ids[:block_size])
        return cls(len(token_ids), expected_output_tokens, key)


@dataclass(frozen=True)
class Estimate:
    """The numbers behind a decision, for the reason, logs and metrics."""

    p_hit_tokens: int
    md_hit_tokens: int
    prefill_s: float
    #: ``wan_transfer_seconds`` of MD's miss: its serialization (and queue) plus one RTT.
    transfer_s: float
    #: Requests on the chosen relay, and what its queue adds to a relayed first token
    #: (0: no relay, or none measured).
    relay_active: int = 0
    relay_queue_s: float = 0.0
    rtt_s: float = 0.0
    md_step_s: float = 0.0  # MD's first step (the path's measured fixed cost)
    #: The codec the router chose for MD's KV (adaptive), None: the deployment's; and
    #: the KV bytes per token it puts on the WAN (None: ``kv_bytes_per_token``).
    kv_codec: KVCodec | None = None
    kv_bytes_per_token: int | None = None
    #: MD computes its miss itself (``PipelinePlan.md_computes_miss``), in this long.
    md_computes_miss: bool = False
    md_compute_s: float = 0.0

    @property
    def md_first_token_s(self) -> float:
        """Where MD computes its miss, P computes nothing on P-MD: the request crosses
        (behind the line's queue), then MD prefills its miss and samples the first token."""
        if self.md_computes_miss:
            crossed = pmd_first_token_seconds(0.0, self.transfer_s, self.rtt_s, self.md_step_s)
            return crossed + self.md_compute_s
        return pmd_first_token_seconds(self.prefill_s, self.transfer_s, self.rtt_s, self.md_step_s)

    @property
    def after_prefill_s(self) -> float:
        """How long after P's prefill MD's first token comes, its step aside: one RTT and
        the serialization the prefill did not cover. What a relay hides."""
        return self.md_first_token_s - self.prefill_s - self.md_step_s


@dataclass(frozen=True)
class Assignment:
    prefill: str
    main_decode: str | None  # None only for P-RLD
    relay: str | None  # None only for P-MD


@dataclass(frozen=True)
class Decision:
    pipeline: Pipeline
    instances: Assignment
    reason: str
    estimate: Estimate


@dataclass(frozen=True)
class Saturated:
    """No instance can take the request now: answer 429 with Retry-After."""

    reason: str
    retry_after_s: float


def decide(
    request: RequestFeatures,
    hits: Mapping[str, int],
    fleet: Fleet,
    link: LinkView,
    traffic: TrafficWindow,
    config: PolicyConfig,
    retry: bool = False,
) -> Decision | Saturated:
    """Choose P and MD, estimate MD's first token, then pick the pipeline.

    ``hits`` is ``PrefixIndex.match``: tokens of this prompt each instance holds.
    ``link``: what is known of the WAN line (its state, doubt, measured rates and the KV
    still crossing that the hits count on; see ``LinkView``).
    ``retry``: the request failed on a worker before; keep a relay on the route.
    """
    n = request.input_tokens
    p = choose_prefill(fleet, hits, n, config.weights)
    if p is None:
        return Saturated("every prefill instance is at capacity", config.retry_after_s)
    md = choose_main_decode(fleet, hits, n, request.affinity_key, config.weights)
    relay = choose_relay(fleet)
    rate = link.prefill_rates.get(p.instance_id, config.prefill_tokens_per_s)
    awaited = link.awaited_bytes.get(md.instance_id, 0) if md else 0
    step = config.md_first_step_s if link.md_step_s is None else link.md_step_s
    p_hit = hits.get(p.instance_id, 0)
    relay_active = relay.active if relay is not None else 0

    def at(kv_bpt: int | None) -> Estimate:
        """The estimate with MD's KV at ``kv_bpt`` bytes per token (None: the default)."""
        e = _estimate(request, p_hit, md, hits, link.state, config, rate, awaited, kv_bpt)
        return replace(
            e, rtt_s=link.state.rtt_s, md_step_s=step,
            relay_active=relay_active, relay_queue_s=link.relay_slot_s * relay_active,
        )  # fmt: skip

    def computed_at_md() -> Estimate | None:
        """MD computes its miss: only the first token crosses (behind the line's queue),
        and MD prefills it behind what it is computing for earlier requests; None where
        the miss is over ``md_recompute_max_tokens`` (or that is 0: off)."""
        cap = config.md_recompute_max_tokens
        if cap == 0:
            return None
        e = at(0)
        miss = n - e.md_hit_tokens
        if miss > cap:
            return None
        md_rate = config.md_prefill_tokens_per_s or rate
        queued = link.md_computing_tokens.get(md.instance_id, 0) if md else 0
        exact = config.adaptive_codecs[0][0] if config.adaptive_codecs else None
        return replace(
            e, md_computes_miss=True, md_compute_s=(queued + miss) / md_rate, kv_codec=exact,
            kv_bytes_per_token=0,
        )  # fmt: skip

    # The deployment's codec; under adaptive the exact one (the first it chooses from).
    estimate = at(config.adaptive_codecs[0][1] if config.adaptive_codecs else None)
    if retry and relay is not None:
        pipeline, reason = retry_pipeline(md is not None)
    else:
        pipeline, reason = choose_pipeline(request, estimate, relay is not None, traffic, config)
        if pipeline == Pipeline.P_MD and link.doubt is not None:
            pipeline, reason = doubted_line_pipeline(link.doubt, relay is not None)
    if pipeline != Pipeline.P_RLD and md is None:
        return Saturated("every main-decode instance is at capacity", config.retry_after_s)
    assignment = Assignment(
        prefill=p.instance_id,
        main_decode=md.instance_id if md and pipeline != Pipeline.P_RLD else None,
        relay=relay.instance_id if relay and pipeline != Pipeline.P_MD else None,
    )
    # Under adaptive, a P-MD whose exact KV misses the budget weighs MD computing against
    # the codecs (``_adaptive_codec``); elsewhere it goes wherever it is the sooner.
    over = bool(config.adaptive_codecs) and estimate.md_first_token_s > config.ttft_budget_s
    if pipeline == Pipeline.P_MD and not over:
        computed = computed_at_md()
        if computed is not None and computed.md_first_token_s < estimate.md_first_token_s:
            note = f"KV computed at MD: {computed.md_first_token_s:.2f}s, sooner than its crossing"
            return Decision(pipeline, assignment, f"{reason}; {note}", computed)
    if config.adaptive_codecs and pipeline != Pipeline.P_RLD:  # nothing crosses on P-RLD
        drain_s = backlog_drain_seconds(link.state)
        estimate, codec_note = _adaptive_codec(
            estimate, pipeline, at, computed_at_md, config, drain_s
        )
        reason = f"{reason}; {codec_note}"
    return Decision(pipeline, assignment, reason, estimate)


def _adaptive_codec(
    exact: Estimate,
    pipeline: Pipeline,
    at: Callable[[int], Estimate],
    computed_at_md: Callable[[], Estimate | None],
    config: PolicyConfig,
    drain_s: float,
) -> tuple[Estimate, str]:
    """Under adaptive: the codec for MD's KV on this pipeline, its estimate, and why.

    Exact where it fits the budget, or where a relay serves the first token on a line
    whose backlog (``drain_s`` to carry) drains within the budget; else MD computing its
    miss where that fits (``md_recompute_max_tokens``: lossless, and it puts nothing on
    the line), else the least lossy codec whose MD first token fits; where nothing fits,
    the soonest of those. A relayed request's KV still crosses, and on a congested line
    every transfer queues behind it: coded, it holds the line (and the relay, until MD
    takes over) a fraction as long."""
    budget = config.ttft_budget_s
    none, none_bpt = config.adaptive_codecs[0]
    relayed = pipeline != Pipeline.P_MD
    if exact.md_first_token_s <= budget or (relayed and drain_s <= budget):
        fits = exact.md_first_token_s <= budget
        why = f"the exact KV fits the {budget:.2f}s budget" if fits else "the relay serves first"
        return replace(exact, kv_codec=none, kv_bytes_per_token=none_bpt), f"KV coded {none}: {why}"
    congested = f" (the line's backlog takes {drain_s:.2f}s to drain)" if relayed else ""
    options: list[tuple[str, Estimate]] = []
    computed = computed_at_md()
    if computed is not None:
        options.append(("computed at MD", computed))
        if computed.md_first_token_s <= budget:
            return computed, f"KV computed at MD: it fits the {budget:.2f}s budget{congested}"
    for codec, kv_bpt in config.adaptive_codecs[1:]:
        coded = replace(at(kv_bpt), kv_codec=codec, kv_bytes_per_token=kv_bpt)
        options.append((f"coded {codec}", coded))
        if coded.md_first_token_s <= budget:
            why = "the least lossy codec that fits"
            return coded, f"KV coded {codec}: {why} the {budget:.2f}s budget{congested}"
    label, estimate = min(options, key=lambda option: option[1].md_first_token_s)
    return estimate, f"KV {label}: nothing fits the {budget:.2f}s budget, the soonest{congested}"


def _estimate(
    request: RequestFeatures,
    p_hit: int,
    md: InstanceLoad | None,
    hits: Mapping[str, int],
    link: LinkState,
    config: PolicyConfig,
    prefill_tokens_per_s: float,
    awaited_bytes: int = 0,
    kv_bytes_per_token: int | None = None,
) -> Estimate:
    n = request.input_tokens
    md_hit = min(hits.get(md.instance_id, 0), n) if md else 0
    p_hit = min(p_hit, n)
    miss = n - md_hit
    kv_bpt = config.kv_bytes_per_token if kv_bytes_per_token is None else kv_bytes_per_token
    return Estimate(
        p_hit_tokens=p_hit,
        md_hit_tokens=md_hit,
        prefill_s=(n - p_hit) / prefill_tokens_per_s,
        transfer_s=wan_transfer_seconds(miss, kv_bpt, link, awaited_bytes),
    )


def choose_pipeline(
    request: RequestFeatures,
    estimate: Estimate,
    relay_available: bool,
    traffic: TrafficWindow,
    config: PolicyConfig,
) -> tuple[Pipeline, str]:
    """The pipeline rules on scalar inputs (see the module docstring)."""
    budget = config.ttft_budget_s
    eta = estimate.md_first_token_s
    if eta <= budget:
        if relay_available and idle_relay_hides(estimate, config):
            return Pipeline.P_RLD_MD, (
                f"MD's first token in {eta:.2f}s fits the {budget:.2f}s budget, but an idle "
                f"relay hides its {estimate.after_prefill_s:.2f}s after the prefill: relaying"
            )
        return Pipeline.P_MD, f"MD's first token in {eta:.2f}s fits the {budget:.2f}s budget"
    slow = f"MD's first token in {eta:.2f}s exceeds the {budget:.2f}s budget"
    if not relay_available:
        return Pipeline.P_MD, f"{slow}, but every relay is saturated: falling back to P-MD"
    if is_anomalous(request, config):
        cap = relay_only_cap_reason(request, traffic, config)
        if cap is None:
            return Pipeline.P_RLD, f"{slow}; anomalous (long input, short output): P-RLD"
    else:
        cap = None
    if relay_not_sooner(estimate):
        return Pipeline.P_MD, (
            f"{slow}, but the relay's queue ({estimate.relay_queue_s:.2f}s) would cost more than "
            f"the transfer it hides ({estimate.after_prefill_s:.2f}s): P-MD"
        )
    if cap is not None:
        return Pipeline.P_RLD_MD, f"{slow}; anomalous but {cap}: relaying"
    return Pipeline.P_RLD_MD, f"{slow}: relaying while the KV crosses the WAN"


def idle_relay_hides(estimate: Estimate, config: PolicyConfig) -> bool:
    """The chosen relay holds no request and MD's first token lags the prefill enough to
    be worth hiding."""
    least = config.idle_relay_min_transfer_s
    return least is not None and estimate.relay_active == 0 and estimate.after_prefill_s >= least


def relay_not_sooner(estimate: Estimate) -> bool:
    """The relay's queue costs at least the wait for MD it would hide."""
    return estimate.relay_queue_s > 0 and estimate.relay_queue_s >= estimate.after_prefill_s


def retry_pipeline(md_available: bool) -> tuple[Pipeline, str]:
    """A retry's pipeline when a relay has room: the relay carries the request if the WAN
    line or MD fails it again."""
    if md_available:
        return Pipeline.P_RLD_MD, "a retry after a failure: relaying, in case MD or the WAN fails"
    return Pipeline.P_RLD, "a retry after a failure, no main decode left: the relay serves it"


def doubted_line_pipeline(doubt: str, relay_available: bool) -> tuple[Pipeline, str]:
    """Where rule 1 chose P-MD over a line in doubt: a relay goes along if one has room."""
    if relay_available:
        return Pipeline.P_RLD_MD, f"{doubt}: relaying, so the relay serves if the KV cannot cross"
    return Pipeline.P_MD, f"{doubt}, but every relay is saturated: P-MD"


def is_anomalous(request: RequestFeatures, config: PolicyConfig) -> bool:
    out = request.expected_output_tokens
    return (
        request.input_tokens >= config.anomalous_min_input_tokens
        and out is not None
        and out < config.anomalous_output_tokens_below
    )


def relay_only_cap_reason(
    request: RequestFeatures, traffic: TrafficWindow, config: PolicyConfig
) -> str | None:
    """Why one more P-RLD request would break a cap, or None when it fits both."""
    share = (traffic.relay_only_requests + 1) / (traffic.requests + 1)
    if share > config.relay_only_max_share:
        return (
            f"P-RLD would be {share:.1%} of recent requests (cap {config.relay_only_max_share:.1%})"
        )
    limit = config.relay_only_max_tokens_per_s
    if limit is not None:
        rate = (traffic.relay_only_input_tokens + request.input_tokens) / traffic.window_s
        if rate > limit:
            return f"P-RLD would take {rate:.0f} input tokens/s (cap {limit:.0f})"
    return None


def reason_code(
    decision: Decision,
    features: RequestFeatures,
    config: PolicyConfig,
    retry: bool = False,
    link_doubted: bool = False,
) -> str:
    """A bounded label for the decision, for metrics (the reason text carries numbers):
    why the policy chose this pipeline. ``retry``: a recovering request; ``link_doubted``:
    the line was doubted when it decided."""
    if retry and decision.pipeline != Pipeline.P_MD:
        return "retry"
    fits = decision.estimate.md_first_token_s <= config.ttft_budget_s
    if link_doubted and fits and decision.pipeline == Pipeline.P_RLD_MD:
        return "link_doubted"
    if fits and decision.pipeline == Pipeline.P_RLD_MD:
        return "idle_relay"
    if decision.pipeline == Pipeline.P_MD:
        if fits:
            return "fits_ttft_budget"
        return "relay_not_sooner" if relay_not_sooner(decision.estimate) else "relays_saturated"
    if decision.pipeline == Pipeline.P_RLD:
        return "anomalous"
    return "anomalous_capped" if is_anomalous(features, config) else "transfer_exceeds_budget"
