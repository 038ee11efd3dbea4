"""The workload a simulation runs: the synthetic generator (:mod:`pdd.simulator.generator`)
or a recorded trace in either format (a sample of each is committed at ``bench/traces/``),
and what the report says about it. Both build a ``Trace[TraceRequest]`` (see
:mod:`pdd.local.traces`): chains of requests. A recorded trace keeps its own shape
(claude-code sessions are closed loop, Mooncake arrivals open loop) and is made lighter
or heavier by scaling its time.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdd.local.traces import Format, load_trace
from pdd.local.traces.base import Trace, TraceRequest, ideal_hit_ratios
from pdd.router.policy import PolicyConfig
from pdd.simulator.generator import GeneratorSpec
from pdd.simulator.hit_mix import HIGH_HIT
from pdd.simulator.stats import percentile


class WorkloadError(ValueError):
    """A workload cannot be built or scaled as asked; the message says why."""


class TraceSpec(BaseModel):
    """A recorded trace (either format), cut and time-scaled."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["trace"] = "trace"
    path: Path = Field(
        description="a trace file or folder; a relative path resolves against build's "
        "base_dir (see load_scenario: --traces, the bundled bench/traces/ sample, or the "
        "scenario file's folder) when given, else the working directory"
    )
    format: Format | None = Field(default=None, description="default: detected from the path")
    max_requests: int | None = Field(
        default=None, ge=1, description="keep the first N requests: whole chains in start order"
    )
    session_gap_s: float = Field(
        default=60.0,
        ge=0,
        description="claude-code sessions have no start time: session i at i x this",
    )
    time_scale: float = Field(
        default=1.0,
        gt=0,
        description="multiplies all trace times; below 1 compresses time (more load)",
    )

    def build(self, base_dir: Path | None = None) -> Trace[TraceRequest]:
        trace = _scale_time(self._load(base_dir), self.time_scale)
        return replace(trace, notes=(*trace.notes, f"trace time x{self.time_scale:.4g}"))

    def with_rate(self, rate: float, base_dir: Path | None = None) -> TraceSpec:
        """This spec with the time scale that makes :func:`offered_rate` equal ``rate``.
        For closed-loop sessions that is requests over the spread of session starts: a
        load knob that scales exactly with time, not the rate answers will let through."""
        if rate <= 0:
            raise WorkloadError(f"rate must be positive, got {rate}")
        natural = offered_rate(self._load(base_dir))
        if natural is None:
            raise WorkloadError(
                f"{self.path}: all chains start at once, so there is no arrival rate to "
                "scale; use more sessions (max_requests) or set time_scale directly"
            )
        return self.model_validate({**self.model_dump(), "time_scale": natural / rate})

    def _load(self, base_dir: Path | None) -> Trace[TraceRequest]:
        path = self.path if base_dir is None or self.path.is_absolute() else base_dir / self.path
        return load_trace(path, self.format, self.session_gap_s, self.max_requests)


WorkloadSpec = Annotated[GeneratorSpec | TraceSpec, Field(discriminator="kind")]


def _scale_time(trace: Trace[TraceRequest], factor: float) -> Trace[TraceRequest]:
    """Starts, subagent delays and think times multiplied by ``factor``."""
    return trace.map(lambda r: replace(r, think_s=r.think_s * factor)).rescale(factor)


def offered_rate(trace: Trace[TraceRequest]) -> float | None:
    """Requests per second over the span of chain start times (None: they all start at
    once). Open loop, that is the arrival rate; closed loop, see ``TraceSpec.with_rate``."""
    starts = [c.start_s for c in trace.chains]
    span = max(starts) - min(starts) if starts else 0.0
    return len(trace) / span if span > 0 else None


def describe(
    trace: Trace[TraceRequest],
    anomalous_min_input_tokens: int = PolicyConfig.default_of("anomalous_min_input_tokens"),
    anomalous_output_below: int = PolicyConfig.default_of("anomalous_output_tokens_below"),
) -> dict[str, float | int | None]:
    """What the report prints about a workload: lengths, ideal (infinite-cache) hits, the
    share of long-input short-output requests, and the offered rate."""
    requests = list(trace.walk())
    inputs = sorted(r.input_tokens for r in requests)
    outputs = sorted(r.output_tokens for r in requests)
    hits = list(ideal_hit_ratios(trace).values())
    n = max(len(requests), 1)
    anomalous = sum(
        r.input_tokens >= anomalous_min_input_tokens and r.output_tokens < anomalous_output_below
        for r in requests
    )
    return {
        "requests": len(requests),
        "input_tokens_mean": sum(inputs) / n,
        "input_tokens_p50": percentile(inputs, 50),
        "input_tokens_p90": percentile(inputs, 90),
        "output_tokens_mean": sum(outputs) / n,
        "output_tokens_p50": percentile(outputs, 50),
        "output_tokens_p90": percentile(outputs, 90),
        "ideal_mean_hit": sum(hits) / n,
        "share_above_95": sum(h > HIGH_HIT for h in hits) / n,
        "anomalous_share": anomalous / n,
        "offered_rate_rps": offered_rate(trace),
    }
