"""The pipeline rules as one table: each rule its condition, pipeline, code and reason.

``decide`` (``pdd.router.policy``) walks ``RULES`` in order and the first rule whose
condition holds chooses the pipeline; the ``x-pdd-reason`` text is that rule's reason
template filled from the facts, and the metric's ``reason`` label is its ``code``. So
nothing derives a code from a reason afterwards, and adding a rule is one entry here:
the policy's docstring lists the table (a test checks it) and docs/router.md's table is
generated from it (``rules_table``).

Each condition reads "and no rule above fired": the table is a first-match list, so a
rule only states what separates it from the rules below it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from pdd.common.vocabulary import Pipeline
from pdd.router.policy_inputs import Estimate, PolicyConfig, RequestFeatures
from pdd.router.recent_traffic import TrafficWindow


@dataclass
class Facts:
    """What the rules read at admission; ``estimate`` is MD's first token on the exact KV
    (the pipeline is chosen on it under any codec). A mapping for ``str.format_map``: a
    reason template names the properties below (``{eta:.2f}``), computed only for the
    rule that fired."""

    request: RequestFeatures
    estimate: Estimate
    config: PolicyConfig
    traffic: TrafficWindow
    relay_available: bool
    md_available: bool
    retry: bool = False
    #: Why the WAN line is in doubt (``LinkView.doubt``), None where it is not.
    doubt: str | None = None
    #: Why one vLLM instance must sample every token (the request's sampling cannot be
    #: resumed on vLLM and a vLLM instance is on the route); None where a handoff may.
    one_sampler: str | None = None

    def __getitem__(self, name: str) -> object:
        return getattr(self, name)

    @cached_property
    def eta(self) -> float:
        return self.estimate.md_first_token_s

    @property
    def budget(self) -> float:
        return self.config.ttft_budget_s

    @cached_property
    def after_prefill(self) -> float:
        return self.estimate.after_prefill_s

    @property
    def relay_queue(self) -> float:
        return self.estimate.relay_queue_s

    @cached_property
    def fits(self) -> bool:
        return self.eta <= self.budget

    @property
    def idle_relay_hides(self) -> bool:
        """The chosen relay holds no request and MD's first token lags the prefill enough
        to be worth hiding."""
        least = self.config.idle_relay_min_transfer_s
        return least is not None and self.estimate.relay_active == 0 and self.after_prefill >= least

    @property
    def relay_not_sooner(self) -> bool:
        """The relay's queue costs at least the wait for MD it would hide."""
        queue = self.relay_queue
        return queue > 0 and queue >= self.after_prefill

    @property
    def anomalous(self) -> bool:
        """Long input, short declared output; no declared output is never anomalous."""
        out = self.request.expected_output_tokens
        return (
            self.request.input_tokens >= self.config.anomalous_min_input_tokens
            and out is not None
            and out < self.config.anomalous_output_tokens_below
        )

    @cached_property
    def cap(self) -> str | None:
        """Why one more P-RLD request would break a cap, or None when it fits both."""
        traffic, config = self.traffic, self.config
        share = (traffic.relay_only_requests + 1) / (traffic.requests + 1)
        if share > config.relay_only_max_share:
            most = config.relay_only_max_share
            return f"P-RLD would be {share:.1%} of recent requests (cap {most:.1%})"
        limit = config.relay_only_max_tokens_per_s
        if limit is not None:
            rate = (traffic.relay_only_input_tokens + self.request.input_tokens) / traffic.window_s
            if rate > limit:
                return f"P-RLD would take {rate:.0f} input tokens/s (cap {limit:.0f})"
        return None


@dataclass(frozen=True)
class Rule:
    """One rule: where ``when`` holds (and no rule above fired), ``pipeline`` serves."""

    #: The metric's ``reason`` label (bounded: the reason text carries numbers).
    code: str
    pipeline: Pipeline
    when: Callable[[Facts], bool]
    #: The condition in words, for the docstring and docs/router.md.
    condition: str
    #: The ``x-pdd-reason`` text, a ``str.format`` template over ``Facts``.
    reason: str

    def explain(self, facts: Facts) -> str:
        return self.reason.format_map(facts)

    def doc_line(self) -> str:
        """The rule's line in the policy's docstring."""
        return f"- ``{self.code}`` ({self.pipeline.value}): {self.condition}"


_FITS = "MD's first token in {eta:.2f}s fits the {budget:.2f}s budget"
_OVER = "MD's first token in {eta:.2f}s exceeds the {budget:.2f}s budget"

#: The rule whose P-MD has MD compute the whole miss, whatever its size (``decide``).
ONE_SAMPLER = "vllm_one_sampler"

RULES: tuple[Rule, ...] = (
    Rule(ONE_SAMPLER, Pipeline.P_MD,
         lambda f: f.one_sampler is not None and f.md_available,
         "sampling vLLM cannot resume, vLLM on the route; an MD is left",
         "{one_sampler}: P-MD, MD computing its miss, so one instance samples every token"),
    Rule("retry", Pipeline.P_RLD_MD,
         lambda f: f.retry and f.relay_available and f.md_available,
         "a retry; a relay has room and an MD is left",
         "a retry after a failure: relaying, in case MD or the WAN fails"),
    Rule("retry_no_main_decode", Pipeline.P_RLD,
         lambda f: f.retry and f.relay_available,
         "a retry; a relay has room, no MD is left",
         "a retry after a failure, no main decode left: the relay serves it"),
    Rule("idle_relay", Pipeline.P_RLD_MD,
         lambda f: f.fits and f.relay_available and f.idle_relay_hides,
         "fits the budget; an idle relay hides MD's lag",
         _FITS + ", but an idle relay hides its {after_prefill:.2f}s after the prefill: relaying"),
    Rule("anomalous", Pipeline.P_RLD,
         lambda f: not f.fits and f.relay_available and f.anomalous and f.cap is None,
         "over budget; long input, short output; under the caps",
         _OVER + "; anomalous (long input, short output): P-RLD"),
    Rule("anomalous_capped", Pipeline.P_RLD_MD,
         lambda f: not f.fits and f.relay_available and f.anomalous and not f.relay_not_sooner,
         "over budget; anomalous but over a cap; the relay is sooner",
         _OVER + "; anomalous but {cap}: relaying"),
    Rule("transfer_exceeds_budget", Pipeline.P_RLD_MD,
         lambda f: not f.fits and f.relay_available and not f.relay_not_sooner,
         "over budget; a relay has room and is sooner",
         _OVER + ": relaying while the KV crosses the WAN"),
    Rule("link_doubted", Pipeline.P_RLD_MD,
         lambda f: f.doubt is not None and f.relay_available,
         "the line is in doubt; a relay has room",
         "{doubt}: relaying, so the relay serves if the KV cannot cross"),
    Rule("link_doubted_relays_saturated", Pipeline.P_MD,
         lambda f: f.doubt is not None,
         "the line is in doubt; every relay saturated",
         "{doubt}, but every relay is saturated: P-MD"),
    Rule("fits_ttft_budget", Pipeline.P_MD,
         lambda f: f.fits,
         "MD's first token fits the TTFT budget",
         _FITS),
    Rule("relays_saturated", Pipeline.P_MD,
         lambda f: not f.relay_available,
         "over budget; every relay saturated",
         _OVER + ", but every relay is saturated: falling back to P-MD"),
    Rule("relay_not_sooner", Pipeline.P_MD,
         lambda f: f.relay_not_sooner,
         "over budget; the relay's queue outlasts the wait it hides",
         _OVER + ", but the relay's queue ({relay_queue:.2f}s) would cost more than the "
         "transfer it hides ({after_prefill:.2f}s): P-MD"),
)  # fmt: skip


def first_rule(facts: Facts) -> Rule:
    """The rule that fires: the first whose condition holds (one always does: past the
    rules above it, the last one's condition is all that is left)."""
    for rule in RULES:
        if rule.when(facts):
            return rule
    raise AssertionError("the last rule holds wherever the rules above it do not")


def rules_table() -> str:
    """docs/router.md's table of the rules, in order."""
    rows = ["| # | `reason` label | pipeline | when (and no rule above fired) | `x-pdd-reason` |",
            "|---|---|---|---|---|"]  # fmt: skip
    for i, rule in enumerate(RULES, 1):
        rows.append(
            f"| {i} | `{rule.code}` | {rule.pipeline.value} | {rule.condition} | `{rule.reason}` |"
        )
    return "\n".join(rows) + "\n"
