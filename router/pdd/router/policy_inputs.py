"""What the pipeline policy reads: its knobs, the request's features and MD's first-token
estimate. Apart from ``pdd.router.policy`` so that the rule table
(``pdd.router.policy_rules``), which ``decide`` walks, reads them without importing
``decide``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pdd.common.block_hash import ROOT_HASH, hash_block
from pdd.common.cost_model import pmd_first_token_seconds
from pdd.common.kv_codec import MD_RECOMPUTE_MAX_TOKENS, KVCodec
from pdd.common.vllm_resume import vllm_resume_refusal
from pdd.common.wire import SamplingSpec
from pdd.router.instance_choice import ChoiceWeights


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
    #: come at least this long after the prefill (rule ``idle_relay``); None: only
    #: requests over budget relay.
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
    #: Why a vLLM instance could not resume this request after a handoff
    #: (``pdd.common.vllm_resume``); None where it could.
    vllm_resume_refusal: str | None = None

    @classmethod
    def from_prompt(
        cls, token_ids: Sequence[int], expected_output_tokens: int | None, block_size: int,
        sampling: SamplingSpec | None = None,
    ) -> RequestFeatures:  # fmt: skip
        """Features of a tokenized prompt; a prompt shorter than one block is keyed by
        the hash of what it has, so it still lands somewhere deterministic."""
        key = hash_block(ROOT_HASH, token_ids[:block_size])
        refusal = None if sampling is None else vllm_resume_refusal(sampling)
        return cls(len(token_ids), expected_output_tokens, key, refusal)


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
