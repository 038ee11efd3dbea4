"""The pipeline policy: which of P-MD, P-RLD-MD, P-RLD serves a request, and on whom.

A pure function of what the router knows at admission: the request's size, the
prefix index's hit estimates, the instances' load (a :class:`Fleet`, only read), the
WAN link's state and the recent share of relay-only traffic. Same inputs, same
decision; no clock, no I/O.

The rules, the first that holds choosing the pipeline (the technique's "only two
pipelines, plus one filter"; each is one ``Rule`` in ``pdd.router.policy_rules.RULES``,
with its ``reason`` label and ``x-pdd-reason`` text, and a test keeps this list equal
to that table):

- ``vllm_one_sampler`` (P-MD): sampling vLLM cannot resume, vLLM on the route; an MD is left
- ``retry`` (P-RLD-MD): a retry; a relay has room and an MD is left
- ``retry_no_main_decode`` (P-RLD): a retry; a relay has room, no MD is left
- ``idle_relay`` (P-RLD-MD): fits the budget; an idle relay hides MD's lag
- ``anomalous`` (P-RLD): over budget; long input, short output; under the caps
- ``anomalous_capped`` (P-RLD-MD): over budget; anomalous but over a cap; the relay is sooner
- ``transfer_exceeds_budget`` (P-RLD-MD): over budget; a relay has room and is sooner
- ``link_doubted`` (P-RLD-MD): the line is in doubt; a relay has room
- ``link_doubted_relays_saturated`` (P-MD): the line is in doubt; every relay saturated
- ``fits_ttft_budget`` (P-MD): MD's first token fits the TTFT budget
- ``relays_saturated`` (P-MD): over budget; every relay saturated
- ``relay_not_sooner`` (P-MD): over budget; the relay's queue outlasts the wait it hides

"The budget" is ``ttft_budget_s`` against ``pmd_first_token_seconds`` (one RTT + the
longer of P's prefill of its miss and the serialization of MD's miss, since P streams
KV while it prefills, + MD's first step), on the live view of the line
(``pdd.common.link_estimator``: measured goodput, the KV already queued on it, all of an
earlier transfer still crossing to MD that the request's hit counts on), P's measured
prefill throughput and the P-MD path's measured fixed cost (MD's step).

Why each rule: an **idle** relay takes a request that fits where MD's first token would
come at least ``idle_relay_min_transfer_s`` after the prefill, since the relay's first
token does not wait for the transfer and the relay would otherwise do nothing; a relay
holding any request is not idle, so under load this never takes relay capacity that a
request over budget needs, and at light load it keeps the tail of new conversations
(their whole KV crosses) near same-datacenter PD's. **P-RLD** serves anomalous traffic
only (input >= ``anomalous_min_input_tokens``, a declared output below
``anomalous_output_tokens_below``) while relay-only traffic stays under its caps (share
of recent requests and input tokens/s), so it can never absorb normal traffic. A request
over budget is relayed only while the relay's own queue (``relay_slot_s``, measured by
the link estimator, per request on it) costs its first token less than the transfer
costs MD's: the relay hides what MD's first token waits for after the prefill (one RTT
and the serialization the prefill did not cover), not the prefill (both paths wait for
that); past that it would only load the relay further ("the relay is sooner" above).

Where P-MD serves, **MD computes its miss** itself from the prompt's IDs when the miss
is at most ``md_recompute_max_tokens`` and that is sooner than the exact KV's crossing
(the line, not P's prefill, sets the exact KV's pace): P computes nothing and nothing
but the request crosses (``PipelinePlan.md_prefills``; Dynamo calls prefilling on the
decode worker conditional disaggregation). It is lossless, so under any codec. The
pipeline is still chosen on the exact KV's estimate, so an idle relay keeps the new
conversations whose KV would lag, and a request over budget is relayed as before.

A request whose sampling **vLLM cannot resume** after a handoff (a seeded draw at
temperature > 0: vLLM seeds the resumed request afresh; ``pdd.common.vllm_resume``) goes
P-MD with MD computing its whole miss, whatever its size, wherever the chosen P, MD or
relay runs vLLM: no handoff, so one instance samples every token and the seed means what
it means on vLLM alone. Requests a handoff serves are routed as before.

A **retry** (the router recovering a request a worker failed) keeps a relay on the
route whenever one has room: the failure may be the WAN line or MD itself, and a relay
in datacenter A carries the request through either; the other rules assume both work.

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
``pdd.router.link_health``) turns what would go P-MD into P-RLD-MD where a relay has
room: the relay serves if the KV cannot cross, and the KV that does cross proves the line.

No available P (or no available MD when the request must end at MD) is a typed
:class:`Saturated` result the server turns into 429 with Retry-After.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from pdd.common.cost_model import (
    LinkState,
    backlog_drain_seconds,
    wan_transfer_seconds,
)
from pdd.common.vocabulary import Pipeline
from pdd.router.fleet import Fleet
from pdd.router.instance_choice import (
    InstanceLoad,
    choose_main_decode,
    choose_prefill,
    choose_relay,
)
from pdd.router.link_view import LinkView
from pdd.router.policy_inputs import Estimate, PolicyConfig, RequestFeatures
from pdd.router.policy_rules import ONE_SAMPLER, Facts, Rule, first_rule
from pdd.router.recent_traffic import TrafficWindow


@dataclass(frozen=True)
class Assignment:
    prefill: str
    main_decode: str | None  # None only for P-RLD
    relay: str | None  # None only for P-MD


@dataclass(frozen=True)
class Decision:
    pipeline: Pipeline
    instances: Assignment
    #: The ``x-pdd-reason`` text: the rule's reason, then the KV's way to MD where it chose one.
    reason: str
    estimate: Estimate
    #: The rule that chose the pipeline; its ``code`` is the metric's ``reason`` label.
    rule: Rule


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
    engines: Mapping[str, str] | None = None,
) -> Decision | Saturated:
    """Choose P and MD, estimate MD's first token, then pick the pipeline.

    ``hits`` is ``PrefixIndex.match``: tokens of this prompt each instance holds.
    ``link``: what is known of the WAN line (its state, doubt, measured rates and the KV
    still crossing that the hits count on; see ``LinkView``).
    ``retry``: the request failed on a worker before; keep a relay on the route.
    ``engines``: each instance's engine (``EngineInfo.engine``; absent: the pdd engine).
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

    def computed_at_md(capped: bool = True) -> Estimate | None:
        """MD computes its miss: only the first token crosses (behind the line's queue),
        and MD prefills it behind what it is computing for earlier requests; None where
        ``capped`` and the miss is over ``md_recompute_max_tokens`` (or that is 0: off)."""
        cap = config.md_recompute_max_tokens
        if capped and cap == 0:
            return None
        e = at(0)
        miss = n - e.md_hit_tokens
        if capped and miss > cap:
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
    one_sampler = _one_sampler(request, engines or {}, (p, md, relay))
    facts = Facts(request, estimate, config, traffic, relay is not None, md is not None,
                  retry, link.doubt, one_sampler)  # fmt: skip
    rule = first_rule(facts)
    pipeline, reason = rule.pipeline, rule.explain(facts)
    if pipeline != Pipeline.P_RLD and md is None:
        return Saturated("every main-decode instance is at capacity", config.retry_after_s)
    assignment = Assignment(
        prefill=p.instance_id,
        main_decode=md.instance_id if md and pipeline != Pipeline.P_RLD else None,
        relay=relay.instance_id if relay and pipeline != Pipeline.P_MD else None,
    )
    if rule.code == ONE_SAMPLER:  # no handoff at all: MD prefills whatever it misses
        computed = computed_at_md(capped=False)
        assert computed is not None  # uncapped, it always is
        return Decision(pipeline, assignment, reason, computed, rule)
    # Under adaptive, a P-MD whose exact KV misses the budget weighs MD computing against
    # the codecs (``_adaptive_codec``); elsewhere it goes wherever it is the sooner.
    over = bool(config.adaptive_codecs) and estimate.md_first_token_s > config.ttft_budget_s
    if pipeline == Pipeline.P_MD and not over:
        computed = computed_at_md()
        if computed is not None and computed.md_first_token_s < estimate.md_first_token_s:
            note = f"KV computed at MD: {computed.md_first_token_s:.2f}s, sooner than its crossing"
            return Decision(pipeline, assignment, f"{reason}; {note}", computed, rule)
    if config.adaptive_codecs and pipeline != Pipeline.P_RLD:  # nothing crosses on P-RLD
        drain_s = backlog_drain_seconds(link.state)
        estimate, codec_note = _adaptive_codec(
            estimate, pipeline, at, computed_at_md, config, drain_s
        )
        reason = f"{reason}; {codec_note}"
    return Decision(pipeline, assignment, reason, estimate, rule)


def _one_sampler(
    request: RequestFeatures, engines: Mapping[str, str], chosen: Iterable[InstanceLoad | None]
) -> str | None:
    """Why one instance must sample every token of this request: its sampling cannot be
    resumed on vLLM after a handoff and a chosen instance runs vLLM; None otherwise."""
    if request.vllm_resume_refusal is None:
        return None
    on_vllm = [c.instance_id for c in chosen if c and engines.get(c.instance_id) == "vllm"]
    if not on_vllm:
        return None
    return f"{request.vllm_resume_refusal} on vLLM ({', '.join(on_vllm)})"


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
