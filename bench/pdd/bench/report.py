"""Per-mode figures from a replay, the cross-mode token check, and the outputs:
a table for the terminal, CSV and JSON for machines.

Latencies are client-side (what ``replay`` measured); WAN bytes come from the link
emulators' counters; pipeline shares, the relay's token share and the P/MD hit
ratios from the router's and workers' Prometheus counters (differences over the run).
Failures are counted by how the client saw them (clean: an OpenAI error body or SSE error
frame), apart where nothing could have served them (a chaos run's ``outages``).
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd.bench.replay import Outcome
from pdd.local.probes import Samples, by_label, total
from pdd.simulator.stats import percentile


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when its first token and its longest pause are in bounds.

    Defaults are for the scaled replay on the tiny model (a colocated stack answers in
    tens of ms here), not the seconds a production SLO would name."""

    ttft_s: float = 0.5
    stall_s: float = 0.5

    def met(self, o: Outcome) -> bool:
        stall = max(o.gaps, default=0.0)
        return o.ok and o.ttft_s is not None and o.ttft_s <= self.ttft_s and stall <= self.stall_s


@dataclass
class ModeRun:
    """Everything measured for one mode."""

    mode: str
    outcomes: list[Outcome]
    wall_s: float
    wan_bytes: int | None = None
    router: Samples = field(default_factory=dict)  # counter differences over the run
    workers: Samples = field(default_factory=dict)
    wan_series: list[tuple[float, int]] = field(default_factory=list)
    #: Workers stopped mid-replay (``--scale-down``): name, role, exit code, drain time.
    scale_down: list[dict[str, Any]] = field(default_factory=list)
    #: What the workers still held after the replay (``quiescence.leaks``); None: not read.
    leaks: dict[str, Any] | None = None
    #: ``--chaos``: the schedule and what ran (``Chaos.document``); None without chaos.
    chaos: dict[str, Any] | None = None
    #: Spans (s since the replay began) in which no instance could serve what a chaos
    #: event broke; a request failing during one is counted as ``failed_no_survivor``.
    outages: list[tuple[float, float]] = field(default_factory=list)
    #: How P coded the KV it sent MD (``--kv-codec``; none where nothing crosses a WAN).
    kv_codec: str = "none"
    #: ``--link-schedule``: the phases as they ran (``link_schedule.document``).
    link_phases: list[dict[str, Any]] | None = None
    #: ``--link-schedule``: the router's link view over the run (``LinkViewSampler``).
    link_view: list[dict[str, float | None]] = field(default_factory=list)
    #: ``--autoscale``: replicas over time and how scale-downs ended (``AutoscaleRun``).
    autoscale: dict[str, Any] | None = None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def hit_ratio(workers: Samples, role: str) -> float | None:
    hit = total(workers, "pdd_worker_prefix_hit_tokens_total", role=role)
    return _ratio(hit, total(workers, "pdd_worker_prompt_tokens_total", role=role))


def during_outage(o: Outcome, outages: Sequence[tuple[float, float]]) -> bool:
    """The request was in flight while nothing could serve part of it."""
    end = o.sent_at + (o.e2e_s or 0.0)
    return any(o.sent_at <= stop and start <= end for start, stop in outages)


def failures(run: ModeRun) -> dict[str, Any]:
    """Failed requests: clean ones (of which during an outage), unclean ones, by reason."""
    failed = [o for o in run.outcomes if o.error is not None]
    clean = [o for o in failed if o.failed_cleanly]
    leaked = run.leaks or {}
    return {
        "failed_clean": len(clean),
        "failed_no_survivor": sum(during_outage(o, run.outages) for o in clean),
        "failed_unclean": len(failed) - len(clean),
        "failure_reasons": dict(Counter(o.error_reason for o in failed).most_common()),
        "leaked_blocks": leaked.get("leaked_blocks"),
        "locked_blocks": leaked.get("locked_blocks"),
        "live_requests": leaked.get("live_requests"),
    }


def summarize(run: ModeRun, slo: Slo) -> dict[str, Any]:
    done = [o for o in run.outcomes if o.ok]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    gaps = [g for o in done for g in o.gaps]
    stalls = [max(o.gaps, default=0.0) for o in done]
    e2e = [o.e2e_s for o in done if o.e2e_s is not None]
    pipelines = by_label(run.router, "pdd_router_requests_total", "pipeline")
    tokens = by_label(run.router, "pdd_router_output_tokens_total", "source_role")
    p_role, md_role = ("mono", "mono") if run.mode == "mono" else ("prefill", "main")
    met = sum(slo.met(o) for o in run.outcomes)
    return {
        "mode": run.mode,
        "requests": len(run.outcomes),
        "completed": len(done),
        "errors": sum(o.error is not None for o in run.outcomes),
        "skipped": sum(o.skipped for o in run.outcomes),
        "retried_429": sum(o.retries > 0 for o in run.outcomes),  # as the OpenAI client does
        "mismatches": 0,  # filled in by compare_outputs
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
        "stall_max": max(stalls, default=None),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
        "wall_s": run.wall_s,
        "slo_attainment": _ratio(met, len(run.outcomes) - sum(o.skipped for o in run.outcomes)),
        "goodput_rps": met / run.wall_s if run.wall_s > 0 else None,
        "wan_bytes": run.wan_bytes,
        "wan_gb": run.wan_bytes / 1e9 if run.wan_bytes is not None else None,
        "kv_wan_bytes_reported": total(run.workers, "pdd_worker_wan_kv_bytes_total"),
        "kv_wan_wire_bytes_reported": total(run.workers, "pdd_worker_wan_kv_coded_bytes_total"),
        "kv_codec": run.kv_codec,
        "agreement": None,  # filled in by agreement
        "handoff_bytes": total(run.workers, "pdd_worker_handoff_bytes_total"),
        "pipeline_share": {k: v / sum(pipelines.values()) for k, v in pipelines.items() if v},
        "rld_token_share": _ratio(tokens.get("relay", 0.0), sum(tokens.values())),
        "p_hit_ratio": hit_ratio(run.workers, p_role),
        "md_hit_ratio": hit_ratio(run.workers, md_role),
        **failures(run),
        "recoveries": by_label(run.router, "pdd_router_recoveries_total", "kind"),
        "chaos_events": len(run.chaos["ran"]) if run.chaos else None,
    }


def compare_outputs(runs: Sequence[ModeRun]) -> dict[str, list[str]]:
    """Per mode: keys of requests whose greedy output differs from the first mode's.

    Only requests completed in both are compared (an error is counted as an error,
    not also as a mismatch)."""
    if not runs:
        return {}
    reference = {o.key: o.text for o in runs[0].outcomes if o.ok}
    return {run.mode: _differing(run, reference) for run in runs}


def agreement(runs: Sequence[ModeRun]) -> dict[str, float | None]:
    """Per mode: the share of output positions equal to the first mode's, over requests
    completed in both (None: nothing to compare). Positions of the text, which for the
    tiny model's byte tokenizer are its tokens; a missing or extra position counts as a
    difference. With a lossy KV codec this is the figure to read, not the mismatches."""
    if not runs:
        return {}
    reference = {o.key: o.text for o in runs[0].outcomes if o.ok}
    return {
        run.mode: share_of_equal_positions(
            (o.text, reference[o.key]) for o in run.outcomes if o.ok and o.key in reference
        )
        for run in runs
    }


def share_of_equal_positions(pairs: Iterable[tuple[Sequence[Any], Sequence[Any]]]) -> float | None:
    """Over pairs of outputs, the share of positions where both hold the same item; a
    position only one of them reaches counts as a difference (None: no positions)."""
    positions = same = 0
    for a, b in pairs:
        positions += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b, strict=False))
    return same / positions if positions else None


def lossy_notes(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """A line per mode whose WAN KV codec is lossy: its outputs are not expected to equal
    the reference's, so its mismatches say how often, not that something broke."""
    if not summaries:
        return []
    reference = summaries[0]["mode"]
    return [
        f"{s['mode']} ran with the lossy KV codec {s['kv_codec']}: {s['mismatches']} of its "
        f"{s['completed']} outputs differ from {reference}'s, "
        + (f"{100 * s['agreement']:.2f}% of positions agree" if s["agreement"] is not None
           else "none compared")
        + " (expected for a lossy codec, not a failure)"
        for s in summaries
        if s["kv_codec"] != "none"
    ]  # fmt: skip


def comparisons(
    summaries: Sequence[dict[str, Any]], gbps: float, rtt_ms: float
) -> dict[str, float]:
    """PDD against naive cross-datacenter PD and against same-datacenter PD, from one run.

    The floor is what any P-MD request must pay over same-datacenter PD: one RTT (the KV
    one way, the first token back) plus the mean KV bytes that crossed per request,
    serialized at the line's rate. Figures whose modes did not run are left out."""
    by_mode = {s["mode"]: s for s in summaries}
    pdd, naive, samedc = by_mode.get("pdd"), by_mode.get("naive"), by_mode.get("samedc")
    out: dict[str, float] = {}
    if pdd and naive and pdd["ttft_p99"] and naive["ttft_p99"]:
        out["pdd_over_naive_ttft_p99"] = pdd["ttft_p99"] / naive["ttft_p99"]
    if pdd and samedc and pdd["ttft_p99"] and samedc["ttft_p99"]:
        out["pdd_over_samedc_ttft_p99"] = pdd["ttft_p99"] / samedc["ttft_p99"]
        out["pdd_minus_samedc_ttft_p50_s"] = pdd["ttft_p50"] - samedc["ttft_p50"]
        sent = pdd["kv_wan_wire_bytes_reported"]
        if sent is not None and pdd["completed"]:
            floor = rtt_ms / 1000 + sent / pdd["completed"] * 8 / (gbps * 1e9)
            out["pmd_floor_s"] = floor
            out["pmd_floor_plus_10ms_s"] = floor + 0.010
    return out


def comparison_lines(c: dict[str, float]) -> list[str]:
    """``comparisons`` as sentences, one per figure that ran."""
    lines = []
    if "pdd_over_naive_ttft_p99" in c:
        lines.append(f"PDD / naive TTFT p99: {c['pdd_over_naive_ttft_p99']:.3f}")
    if "pdd_over_samedc_ttft_p99" in c:
        lines.append(f"PDD / same-DC TTFT p99: {c['pdd_over_samedc_ttft_p99']:.3f}")
        diff_ms = 1000 * c["pdd_minus_samedc_ttft_p50_s"]
        line = f"PDD - same-DC TTFT p50: {diff_ms:.1f} ms"
        if "pmd_floor_s" in c:
            line += (
                f" (floor: 1 RTT + the mean KV crossing per request at the line's rate = "
                f"{1000 * c['pmd_floor_s']:.1f} ms; floor + 10 ms = "
                f"{1000 * c['pmd_floor_plus_10ms_s']:.1f} ms)"
            )
        lines.append(line)
    return lines


def _differing(run: ModeRun, reference: dict[str, str]) -> list[str]:
    return sorted(
        o.key for o in run.outcomes if o.ok and o.key in reference and o.text != reference[o.key]
    )


# -- outputs -----------------------------------------------------------------------------

_TABLE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", "d"),
    ("errors", "errors", "d"),
    ("skipped", "skipped (too long)", "d"),
    ("mismatches", "token mismatches", "d"),
    ("kv_codec", "KV codec on the WAN", "s"),
    ("agreement", "output agreement with the first mode", ".4f"),
    ("ttft_p50", "TTFT p50 (s)", ".3f"),
    ("ttft_p90", "TTFT p90 (s)", ".3f"),
    ("ttft_p99", "TTFT p99 (s)", ".3f"),
    ("itl_p50", "ITL p50 (s)", ".4f"),
    ("itl_p99", "ITL p99 (s)", ".4f"),
    ("stall_max", "largest stall (s)", ".3f"),
    ("e2e_p50", "end-to-end p50 (s)", ".3f"),
    ("e2e_p99", "end-to-end p99 (s)", ".3f"),
    ("slo_attainment", "within SLO (share)", ".3f"),
    ("goodput_rps", "goodput (req/s in SLO)", ".3f"),
    ("wan_gb", "WAN GB", ".4f"),
    ("kv_wan_bytes_reported", "WAN KV bytes (raw)", ".0f"),
    ("kv_wan_wire_bytes_reported", "WAN KV bytes (as sent)", ".0f"),
    ("rld_token_share", "tokens from RLD", ".3f"),
    ("p_hit_ratio", "P hit ratio", ".3f"),
    ("md_hit_ratio", "MD hit ratio", ".3f"),
)


#: The chaos table (``--chaos``): what ended how, and what was left behind.
_CHAOS_ROWS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", "d"),
    ("completed", "completed", "d"),
    ("failed_clean", "failed cleanly", "d"),
    ("failed_no_survivor", "... of which with no survivor", "d"),
    ("failed_unclean", "failed otherwise (broken stream)", "d"),
    ("skipped", "skipped (too long)", "d"),
    ("mismatches", "token mismatches", "d"),
    ("leaked_blocks", "leaked KV blocks", "d"),
    ("locked_blocks", "held prefix locks", "d"),
    ("live_requests", "requests still in flight", "d"),
    ("chaos_events", "chaos events run", "d"),
)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt)


def _pipelines(summary: dict[str, Any]) -> str:
    share = summary["pipeline_share"]
    return " ".join(f"{k}:{v:.2f}" for k, v in sorted(share.items())) or "-"


def table(summaries: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: one column per mode, one row per figure."""
    modes = [s["mode"] for s in summaries]
    lines = ["| | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for key, label, fmt in _TABLE_ROWS:
        lines.append(f"| {label} | " + " | ".join(_cell(s[key], fmt) for s in summaries) + " |")
    lines.append("| pipelines (share) | " + " | ".join(_pipelines(s) for s in summaries) + " |")
    return "\n".join(lines)


def chaos_table(summaries: Sequence[dict[str, Any]]) -> str:
    """The outcome of a chaos run per mode, router recoveries and failure reasons included."""
    modes = [s["mode"] for s in summaries]
    lines = ["| | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for key, label, fmt in _CHAOS_ROWS:
        lines.append(f"| {label} | " + " | ".join(_cell(s[key], fmt) for s in summaries) + " |")
    for key, label in (
        ("recoveries", "router recoveries"),
        ("failure_reasons", "failures by reason"),
    ):
        cells = [
            " ".join(f"{k}:{v:g}" for k, v in sorted(s[key].items())) or "-" for s in summaries
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(summaries: Sequence[dict[str, Any]], path: Path) -> None:
    nested = ("pipeline_share", "recoveries", "failure_reasons")
    rows = [{**s, **{k: json.dumps(s[k]) for k in nested}} for s in summaries]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_json(document: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(document, indent=2))


def write_requests_csv(runs: Sequence[ModeRun], path: Path) -> None:
    """One row per request and mode, for digging past the summary."""
    fields = ["mode", "key", "sent_at", "prompt_tokens", "max_tokens", "completion_tokens",
              "cached_tokens", "ttft_s", "e2e_s", "stall_s", "skipped", "error_kind",
              "error_reason", "error"]  # fmt: skip
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for run in runs:
            for o in run.outcomes:
                stall = max(o.gaps, default=None)
                writer.writerow([run.mode, o.key, f"{o.sent_at:.4f}", o.prompt_tokens,
                                 o.max_tokens, o.completion_tokens, o.cached_tokens, o.ttft_s,
                                 o.e2e_s, stall, o.skipped, o.error_kind, o.error_reason,
                                 o.error])  # fmt: skip
