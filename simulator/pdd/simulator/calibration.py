"""Fit the step model's efficiency knobs to a device, from the worker's own step profile.

``bench/step_profile.py`` times real engine steps (prefills, decodes, extends) on a
device and writes a :class:`StepProfile`; :func:`fit_efficiency` then finds the
``mfu``, ``mbu`` and ``overhead_s`` for which :meth:`InstanceShape.step_seconds`
best reproduces those times (least squared *relative* error, so a 2 ms decode
counts as much as a 200 ms prefill). ``pdd calibrate``
(:mod:`pdd.simulator.calibrate_cli`) wraps both and writes the GPU type, with the
fitted efficiency, as a scenario's YAML.

The fit needs no scipy: ``overhead_s`` enters every prediction additively, so for
given ``mfu`` and ``mbu`` its best value has a closed form; the two remaining
knobs are searched on a log-space grid, then refined by a compass search.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdd.simulator.hardware import Efficiency, GpuType, HardwareError, InstanceShape, ModelSpec

Kind = Literal["prefill", "decode", "extend"]
KINDS: tuple[Kind, ...] = ("prefill", "decode", "extend")


class CalibrationError(ValueError):
    """A profile or a GPU description that cannot be fitted; the message says the fix."""


# --- the profile (the one schema; the bench writes through these models) -----------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProfiledModel(_Strict):
    """:class:`ModelSpec`'s fields, derived by the bench from the checkpoint it ran."""

    name: str
    active_params_b: float = Field(gt=0)  # non-embedding parameters / 1e9 (bench's choice)
    weight_gb: float = Field(gt=0)  # bytes of all weights in the profiled dtype / 1e9
    kv_bytes_per_token: int = Field(gt=0)
    attention_flops_per_pair: float = Field(ge=0)  # 4 x layers x heads x head_dim
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)

    def to_spec(self) -> ModelSpec:
        return ModelSpec(**self.model_dump())


class StepSample(_Strict):
    """One timed step, in :meth:`InstanceShape.step_seconds`'s terms.

    prefill / extend of n tokens after c cached: new n, kv_read c + n, pairs n*c + n*n/2;
    decode of b sequences holding c tokens each: new b, kv_read = pairs = b*c.
    """

    kind: Kind
    new_tokens: float = Field(gt=0)
    kv_read_tokens: float = Field(ge=0)
    attention_pairs: float = Field(ge=0)
    seconds: float = Field(gt=0)  # median of the repeats


class StepProfile(_Strict):
    device: str
    dtype: str
    model: ProfiledModel
    samples: list[StepSample] = Field(min_length=1)


def load_profile(path: str | Path) -> StepProfile:
    """Read and validate a step profile; :class:`CalibrationError` names what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CalibrationError(f"cannot read profile {path}: {e.strerror}") from e
    try:
        return StepProfile.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise CalibrationError(
            f"{path} is not a step profile: {where}: {first['msg']} "
            f"({e.error_count()} error(s)); regenerate it with bench/step_profile.py"
        ) from e


# --- the fit ------------------------------------------------------------------------------------
LOG10_MIN = -6.0  # search mfu, mbu in [1e-6, 1]: far below any real engine
_GRID_STEP = 0.25  # decades between grid points
_REFINE_UNTIL = 1e-4  # decades: compass search stops below this step
_BAD_FIT = 0.25  # a kind's median error above this gets a warning


@dataclass(frozen=True)
class KindFit:
    kind: Kind
    samples: int
    median_error: float  # median |predicted - measured| / measured


@dataclass(frozen=True)
class FitResult:
    efficiency: Efficiency
    per_kind: tuple[KindFit, ...]  # only the kinds the profile holds
    rms_error: float  # root mean squared relative error over all samples
    warnings: tuple[str, ...]


def fit_efficiency(
    model: ModelSpec, gpu: GpuType, gpus: int, samples: Sequence[StepSample]
) -> FitResult:
    """The efficiency that best reproduces ``samples`` on ``gpus`` x ``gpu`` serving ``model``.

    ``gpu.efficiency`` is the prior: a knob the samples cannot pin down (every value
    fits equally well) keeps its prior value, with a warning.
    """
    if not samples:
        raise CalibrationError("no samples to fit; profile some prefill and decode steps")
    try:
        shape = InstanceShape(gpu, gpus, model)
    except HardwareError as e:
        raise CalibrationError(str(e)) from e
    fit = _Fitter(shape, samples)
    prior = gpu.efficiency
    eff, errors = fit.evaluate(*fit.search((math.log10(prior.mfu), math.log10(prior.mbu))))
    per_kind = tuple(
        KindFit(k, len(errs), statistics.median(errs))
        for k in KINDS
        if (errs := [abs(x) for x, s in zip(errors, samples, strict=True) if s.kind == k])
    )
    rms = math.sqrt(statistics.fmean(x * x for x in errors))
    return FitResult(eff, per_kind, rms, tuple(_warnings(fit, eff, gpu, per_kind)))


class _Fitter:
    """The objective over (log10 mfu, log10 mbu), with overhead_s solved exactly."""

    def __init__(self, shape: InstanceShape, samples: Sequence[StepSample]) -> None:
        self.shape = shape
        self.samples = samples
        self.measured = [s.seconds for s in samples]

    def predict(self, eff: Efficiency) -> list[float]:
        shape = replace(self.shape, gpu=replace(self.shape.gpu, efficiency=eff))
        return [
            shape.step_seconds(s.new_tokens, s.kv_read_tokens, s.attention_pairs)
            for s in self.samples
        ]

    def evaluate(self, u: float, v: float) -> tuple[Efficiency, list[float]]:
        """Knobs at (u, v) with their best overhead, and each sample's relative error.

        With g the prediction at zero overhead and weights 1/y^2, the loss
        sum(((o + g - y) / y)^2) is minimised at o = sum((y - g) / y^2) / sum(1 / y^2),
        clamped to o >= 0 (the loss is convex in o).
        """
        eff = Efficiency(10**u, 10**v, 0.0)
        bare = self.predict(eff)
        num = sum((y - g) / y**2 for g, y in zip(bare, self.measured, strict=True))
        den = sum(1 / y**2 for y in self.measured)
        o = max(0.0, num / den)
        errors = [(g + o - y) / y for g, y in zip(bare, self.measured, strict=True)]
        return replace(eff, overhead_s=o), errors

    def loss(self, u: float, v: float) -> float:
        """Sum of squared relative errors, rounded so a flat direction gives exact ties."""
        return float(f"{sum(e * e for e in self.evaluate(u, v)[1]):.12g}")

    def search(self, prior: tuple[float, float]) -> tuple[float, float]:
        """Best grid point (ties go to the one nearest the prior), then a compass search."""
        n = round(-LOG10_MIN / _GRID_STEP)
        axis = [LOG10_MIN + i * _GRID_STEP for i in range(n + 1)]
        points = [prior, *((u, v) for u in axis for v in axis)]

        def rank(p: tuple[float, float]) -> tuple[float, float]:
            return (self.loss(*p), math.dist(p, prior))

        return _compass(self.loss, min(points, key=rank))


def _compass(f: Callable[[float, float], float], start: tuple[float, float]) -> tuple[float, float]:
    """Move to a better neighbour along an axis while one exists, else halve the step."""
    best, value, step = start, f(*start), _GRID_STEP / 2
    while step >= _REFINE_UNTIL:
        for du, dv in ((step, 0), (-step, 0), (0, step), (0, -step)):
            cand = (_clamp(best[0] + du), _clamp(best[1] + dv))
            if (cand_value := f(*cand)) < value:
                best, value = cand, cand_value
                break
        else:
            step /= 2
    return best


def _clamp(x: float) -> float:
    return min(0.0, max(LOG10_MIN, x))


def _warnings(
    fit: _Fitter, eff: Efficiency, gpu: GpuType, per_kind: Sequence[KindFit]
) -> list[str]:
    """What the user should know before trusting the fitted knobs."""
    kinds = {k.kind for k in per_kind}
    out = []
    if len(fit.samples) < 3:
        out.append(f"only {len(fit.samples)} samples for 3 knobs: the fit is underdetermined")
    knobs = (
        ("mfu", "compute", "peak_tflops", "prefill" in kinds or "extend" in kinds, "prefill"),
        ("mbu", "memory", "memory_bandwidth_tbps", "decode" in kinds, "decode"),
    )
    for knob, term, axis, has_kind, kind in knobs:
        value = getattr(eff, knob)
        if not has_kind:
            out.append(
                f"no {kind} samples: {knob} is unidentifiable for {kind} steps ({value:g} rests "
                f"on the other kinds or the prior); profile {kind} steps too"
            )
        elif not _binds(fit, eff, knob):
            out.append(
                f"{knob} is unidentifiable: the {term} term bounds none of the samples "
                f"(kept {value:g}); profile larger {kind} steps"
            )
        elif value >= 1.0:
            out.append(
                f"{knob} hit the bound 1.0: the declared {axis} ({getattr(gpu, axis):g}) is too "
                "low for this device"
            )
        elif value <= 10**LOG10_MIN * (1 + 1e-9):
            out.append(
                f"{knob} hit the bound {10**LOG10_MIN:g}: the declared {axis} "
                f"({getattr(gpu, axis):g}) is far above what this device reached"
            )
    out += [
        f"{k.kind} steps: median error {k.median_error:.0%}; the step model fits them poorly"
        for k in per_kind
        if k.median_error > _BAD_FIT
    ]
    return out


def _binds(fit: _Fitter, eff: Efficiency, knob: str) -> bool:
    """True when lowering ``knob`` a little slows some predicted step (its term is the max)."""
    lowered = replace(eff, **{knob: getattr(eff, knob) * (1 - 1e-3)})
    return any(b > a for a, b in zip(fit.predict(eff), fit.predict(lowered), strict=True))
