"""The WAN cost model: one set of formulas for the router's per-request pipeline choice
and the operator's link sizing, so the two can never disagree about what a link can carry.

Pure Python, no torch, no I/O. Every number that is an assumption lives in a named
constant below with the reason it was chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdd.common.kv_codec import NO_CODEC, KVCodec, chunk_wire_bytes

#: Bytes per element for the dtype names found in Hugging Face ``config.json`` files.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

#: Shape parameter of the per-request *miss fraction* distribution, Beta(MISS_SHAPE, b).
#: The technique reports a skewed hit rate: ~90% mean, and 70-80% of requests hit above
#: 95%. With the miss fraction ~ Beta(0.08, 0.08 * hit / (1 - hit)) a 90% mean gives
#: P(hit > 95%) ~= 0.75, mid-band; a shape far below 1 puts most mass near a full
#: hit and a thin tail out to total misses, which is the "few slow transfers" picture.
MISS_SHAPE = 0.08

#: Seconds of RLD occupancy after MD has the KV: the token-ID handoff and MD's extend
#: pass (the technique measures ~0.3 s for a 100-token handoff; we round up).
HANDOFF_SECONDS = 0.5

#: Requests one relay (RLD) replica decodes concurrently: a small decode batch, because
#: RLD only bridges the gap until MD's KV arrives and must keep per-token latency low.
RELAY_CONCURRENCY_PER_REPLICA = 32

_GIGA = 1e9
_BITS_PER_BYTE = 8


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
    codec: KVCodec = NO_CODEC,
) -> int:  # fmt: skip
    """KV bytes one token occupies: a K and a V vector per layer per KV head.

    With a ``codec`` (``spec.wan.kvCodec``), the bytes it takes on the WAN instead: one
    token's codes and scales, exactly what a chunk spends per token (the codecs scale
    each token on its own). The router's transfer estimate and the operator's link
    sizing both come through here.
    """
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return chunk_wire_bytes(codec, num_layers, 1, num_kv_heads, head_dim, dtype_bytes)


def kv_bytes_per_token_from_hf_config(
    config: dict, dtype_bytes: int | None = None, codec: KVCodec = NO_CODEC
) -> int:
    """KV bytes per token from a Hugging Face ``config.json`` dict.

    Multimodal configs nest the language model under ``text_config``; that is used when
    present. ``dtype_bytes`` overrides the checkpoint's dtype (e.g. an fp8 KV cache);
    ``codec`` gives the bytes on the WAN (see ``kv_bytes_per_token``).
    """
    cfg = config.get("text_config", config)
    layers = _require(cfg, "num_hidden_layers")
    heads = _require(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or _require(cfg, "hidden_size") // heads
    if dtype_bytes is None:
        dtype_bytes = _dtype_bytes(
            cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype")
        )
    return kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes, codec)


def _require(cfg: dict, key: str) -> int:
    if key not in cfg:
        raise ValueError(f"config.json has no {key!r}; cannot size the KV cache without it")
    return int(cfg[key])


def _dtype_bytes(dtype: str | None) -> int:
    if dtype is None:
        raise ValueError(
            "config.json has no 'torch_dtype' (or 'dtype'); pass dtype_bytes explicitly"
        )
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class LinkState:
    """A WAN link as the router and operator see it: what was declared, what was measured,
    and the KV already committed to it (``pdd.common.link_estimator`` fills the last two)."""

    declared_gbps: float
    rtt_ms: float
    measured_goodput_gbps: float | None = None
    #: KV bytes dispatched onto the line and not yet landed, and how many transfers.
    backlog_bytes: int = 0
    backlog_transfers: int = 0

    def __post_init__(self) -> None:
        if self.declared_gbps <= 0:
            raise ValueError(f"declared_gbps must be positive, got {self.declared_gbps}")
        if self.rtt_ms < 0:
            raise ValueError(f"rtt_ms must be >= 0, got {self.rtt_ms}")
        if self.backlog_bytes < 0 or self.backlog_transfers < 0:
            raise ValueError("a link's backlog cannot be negative")

    @property
    def effective_gbps(self) -> float:
        """Measured goodput when known (and > 0), else the declared bandwidth.

        Goodput wins because it already counts cross traffic and TCP behaviour on a
        long fat pipe; a zero measurement means "no sample yet", not "dead link".
        """
        if self.measured_goodput_gbps is not None and self.measured_goodput_gbps > 0:
            return self.measured_goodput_gbps
        return self.declared_gbps

    @property
    def rtt_s(self) -> float:
        return self.rtt_ms / 1000.0


def queued_ahead_bytes(link: LinkState, nbytes: int) -> int:
    """Backlog bytes that cross before the last of ``nbytes`` new ones: the line shares
    itself fairly between transfers (processor sharing, as TCP flows roughly do), so each
    transfer ahead delays the new one by at most the new one's own size, and all of them
    by at most what they still hold."""
    return min(link.backlog_bytes, link.backlog_transfers * nbytes)


def wan_transfer_seconds(
    miss_tokens: int, kv_bytes_per_token: int, link: LinkState, awaited_bytes: int = 0
) -> float:
    """Seconds to ship ``miss_tokens`` tokens of KV over ``link``: one RTT, plus the
    serialization of the miss and of the backlog it queues behind. ``awaited_bytes``:
    KV still crossing to the same MD that the request's hit counts on (an earlier turn's
    transfer, which MD lets land before it attaches): the request waits for all of it,
    not for the fair share a transfer of its own size would."""
    if miss_tokens < 0 or awaited_bytes < 0:
        raise ValueError(f"token and byte counts must be >= 0: {miss_tokens}, {awaited_bytes}")
    nbytes = miss_tokens * kv_bytes_per_token
    ahead = max(queued_ahead_bytes(link, nbytes), awaited_bytes)
    return _serialization_seconds(nbytes + ahead, link) + link.rtt_s


def backlog_drain_seconds(link: LinkState) -> float:
    """Seconds the line needs to carry the KV already committed to it, at its live rate:
    how congested it is, whatever the next transfer's size."""
    return _serialization_seconds(link.backlog_bytes, link)


def _serialization_seconds(nbytes: int, link: LinkState) -> float:
    return nbytes * _BITS_PER_BYTE / (link.effective_gbps * _GIGA)


def pmd_first_token_seconds(
    prefill_s: float, transfer_s: float, rtt_s: float, md_step_s: float = 0.0
) -> float:
    """Seconds from dispatch to MD's first token on P-MD: one RTT, then the longer of P's
    prefill and the line's serialization, then MD's first step.

    ``transfer_s`` is ``wan_transfer_seconds`` (serialization and one RTT). P streams each
    prefill chunk's KV as its step ends, so the line carries the KV while P computes the
    rest: the two overlap and the slower one sets the pace, not their sum. (Only the
    last chunk's KV must follow the prefill: a few hundred tokens, within the estimate's
    error on the line's rate.) The router's policy and the simulator both use this.
    """
    if min(prefill_s, transfer_s, rtt_s, md_step_s) < 0:
        raise ValueError(
            f"times must be >= 0: prefill {prefill_s}, transfer {transfer_s}, rtt {rtt_s}, "
            f"md step {md_step_s}"
        )
    serialization_s = max(0.0, transfer_s - rtt_s)
    return rtt_s + max(prefill_s, serialization_s) + md_step_s


@dataclass(frozen=True)
class WorkloadProfile:
    """The traffic a deployment expects, in the terms the link sizing needs."""

    request_rate: float  # requests / s
    mean_input_tokens: float
    mean_output_tokens: float
    mean_md_hit_rate: float  # 0..1, the decode side's prefix-cache hit rate

    def __post_init__(self) -> None:
        if self.request_rate < 0 or self.mean_input_tokens < 0 or self.mean_output_tokens < 0:
            raise ValueError(f"workload rates and token counts must be >= 0: {self}")
        if not 0.0 <= self.mean_md_hit_rate <= 1.0:
            raise ValueError(f"mean_md_hit_rate must be in [0, 1], got {self.mean_md_hit_rate}")


@dataclass(frozen=True)
class LinkSizing:
    """The operator's verdict on a WAN link for a workload."""

    required_gbps: float
    declared_gbps: float
    headroom: float  # declared / required (inf when nothing must cross)
    sufficient: bool  # effective bandwidth covers required_gbps
    expected_relay_share: float  # share of requests whose miss transfer exceeds the TTFT budget
    relay_replicas_min: int
    relay_replicas_max: int


def size_wan_link(
    workload: WorkloadProfile,
    kv_bytes_per_token: int,
    link: LinkState,
    ttft_budget_s: float,
    burst_factor: float = 2.0,
    relay_capacity_rps: float | None = None,
) -> LinkSizing:
    """Size the WAN link and the relay pool for ``workload``.

    ``required_gbps`` is the mean miss-KV bit rate times ``burst_factor``. The relay
    share is P(a request's miss transfer > ``ttft_budget_s``) with the miss fraction
    ~ Beta(MISS_SHAPE, ...) at the workload's mean hit rate and every request at the
    mean input length. Relay replicas come from Little's law: relayed rps x mean
    occupancy (the slow transfer + HANDOFF_SECONDS) / RELAY_CONCURRENCY_PER_REPLICA,
    unless ``relay_capacity_rps`` (relayed requests/s one replica absorbs) is given.
    The minimum covers the mean load, the maximum the burst; both are at least 1
    because anomalous traffic (P-RLD) needs a relay even when the link is ample.
    """
    if ttft_budget_s <= 0:
        raise ValueError(f"ttft_budget_s must be positive, got {ttft_budget_s}")
    if burst_factor < 1:
        raise ValueError(f"burst_factor must be >= 1, got {burst_factor}")
    miss = 1.0 - workload.mean_md_hit_rate
    bits_per_request = workload.mean_input_tokens * miss * kv_bytes_per_token * _BITS_PER_BYTE
    required = workload.request_rate * bits_per_request / _GIGA * burst_factor
    # Serialization time of a full miss, and the miss fraction that overruns the budget.
    serial_full = workload.mean_input_tokens * kv_bytes_per_token * _BITS_PER_BYTE
    serial_full /= link.effective_gbps * _GIGA
    threshold = (ttft_budget_s - link.rtt_s) / serial_full if serial_full > 0 else math.inf
    share, slow_miss = _tail_share_and_mean(miss, threshold)
    if relay_capacity_rps is None:
        occupancy = slow_miss * serial_full + link.rtt_s + HANDOFF_SECONDS
        relay_capacity_rps = RELAY_CONCURRENCY_PER_REPLICA / occupancy
    replicas_min, replicas_max = _relay_replicas(
        share * workload.request_rate, relay_capacity_rps, burst_factor
    )
    return LinkSizing(
        required_gbps=required,
        declared_gbps=link.declared_gbps,
        headroom=link.declared_gbps / required if required > 0 else math.inf,
        sufficient=link.effective_gbps >= required,
        expected_relay_share=share,
        relay_replicas_min=replicas_min,
        relay_replicas_max=replicas_max,
    )


def _relay_replicas(relayed_rps: float, capacity_rps: float, burst: float) -> tuple[int, int]:
    """Replicas for the mean and the burst relayed load; at least one (P-RLD needs it)."""
    if capacity_rps <= 0:
        raise ValueError(f"relay_capacity_rps must be positive, got {capacity_rps}")
    low = max(1, math.ceil(relayed_rps / capacity_rps))
    return low, max(low, math.ceil(relayed_rps * burst / capacity_rps))


def _tail_share_and_mean(mean_miss: float, threshold: float) -> tuple[float, float]:
    """P(miss > threshold) and E[miss | miss > threshold] for the skewed miss model."""
    if threshold < 0.0:  # the RTT alone overruns the budget: every request is slow
        return 1.0, mean_miss
    if threshold >= 1.0 or mean_miss <= 0.0:
        return 0.0, 0.0
    if mean_miss >= 1.0:  # a degenerate distribution: every request misses fully
        return 1.0, 1.0
    a = MISS_SHAPE
    b = MISS_SHAPE * (1.0 - mean_miss) / mean_miss
    share = 1.0 - regularized_incomplete_beta(threshold, a, b)
    if share <= 0.0:
        return 0.0, 0.0
    # E[X; X > t] = mean * (1 - I_t(a + 1, b)) for X ~ Beta(a, b).
    tail_mass = mean_miss * (1.0 - regularized_incomplete_beta(threshold, a + 1.0, b))
    return share, min(1.0, tail_mass / share)


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the Beta(a, b) CDF, by Lentz's continued fraction (no scipy needed)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    # The fraction converges fast only for x < (a + 1) / (a + b + 2); use symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(x, a, b) / a
    return 1.0 - front * _beta_continued_fraction(1.0 - x, b, a) / b


def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return result
