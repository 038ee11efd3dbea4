"""Scenario files: the schema of a simulation, as pydantic models (the one source of truth).

A scenario names the model, the GPU types (four axes and a price), the WAN line and
the in-datacenter fabric, the SLO, the router's knobs, the workload, and the systems
to compare, each a set of pools. ``load_scenario`` takes a shipped name
(``published``) or a path to a YAML file; errors name the field and the fix.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdd.common.kv_codec import KVCodecSetting
from pdd.local.traces import BUNDLED_TRACES
from pdd.router.policy import PolicyConfig
from pdd.simulator.hardware import Efficiency, GpuType, InstanceShape, ModelSpec
from pdd.simulator.workload import WorkloadSpec

SCENARIO_DIR = Path(__file__).parent / "scenarios"


class ScenarioError(ValueError):
    """A scenario that cannot be found, parsed or run; the message says which and why."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EfficiencySpec(_Spec):
    mfu: float = Field(default=0.5, gt=0, le=1, description="achieved / peak FLOP/s")
    mbu: float = Field(default=0.8, gt=0, le=1, description="achieved / peak memory bandwidth")
    overhead_s: float = Field(default=0.002, ge=0, description="fixed seconds per engine step")


class GpuSpec(_Spec):
    peak_tflops: float = Field(gt=0)
    memory_gb: float = Field(gt=0)
    memory_bandwidth_tbps: float = Field(gt=0)
    interconnect_gbps: float = Field(gt=0, description="GB/s between chips of one instance")
    price_per_hour: float = Field(ge=0)
    efficiency: EfficiencySpec = EfficiencySpec()

    def build(self, name: str) -> GpuType:
        return GpuType(
            name=name,
            efficiency=Efficiency(**self.efficiency.model_dump()),
            **self.model_dump(exclude={"efficiency"}),
        )


class ModelSpecFile(_Spec):
    name: str
    active_params_b: float = Field(gt=0)
    weight_gb: float = Field(gt=0)
    kv_bytes_per_token: int = Field(gt=0)
    attention_flops_per_pair: float = Field(ge=0)
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)

    def build(self) -> ModelSpec:
        return ModelSpec(**self.model_dump())


class WanSpec(_Spec):
    gbps: float = Field(gt=0)
    rtt_ms: float = Field(ge=0)
    jitter_ms: float = Field(default=0.0, ge=0, description="std of the extra one-way delay")
    price_per_hour: float = Field(default=0.0, ge=0, description="the leased line's cost")
    kv_codec: KVCodecSetting = Field(
        default="none",
        description="spec.wan.kvCodec: how P codes MD's KV on the line (adaptive: the "
        "router's choice per request)",
    )
    kv_head_dim: int = Field(
        default=128,
        gt=0,
        description="the model's head dim: sets a lossy codec's per-vector scales",
    )


class InDcSpec(_Spec):
    gbps: float = Field(default=400.0, gt=0, description="per-NIC RDMA bandwidth")
    latency_ms: float = Field(default=0.05, ge=0)


class SloSpec(_Spec):
    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)


class BillingSpec(_Spec):
    """What a request earns, for the benefit figure of the bathtub: providers bill cached
    input at 10-25% of uncached input, so a higher hit rate also earns less per request."""

    input_per_mtok: float = Field(
        default=1.0, ge=0, description="$ per million uncached input tokens"
    )
    cached_input_ratio: float = Field(
        default=0.2, ge=0, le=1, description="cached input's share of that"
    )
    output_per_mtok: float = Field(default=4.0, ge=0, description="$ per million output tokens")

    def revenue(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        uncached = input_tokens - cached_tokens
        billed = uncached + cached_tokens * self.cached_input_ratio
        return (billed * self.input_per_mtok + output_tokens * self.output_per_mtok) / 1e6


class RouterSpec(_Spec):
    """The router's PolicyConfig knobs (pdd.router.policy); defaults are the router's."""

    ttft_budget_s: float = Field(default=PolicyConfig.default_of("ttft_budget_s"), gt=0)
    prefill_tokens_per_s: float | None = Field(
        default=None, gt=0, description="default: the P pool's full-chunk throughput"
    )
    anomalous_min_input_tokens: int = Field(
        default=PolicyConfig.default_of("anomalous_min_input_tokens"), gt=0
    )
    anomalous_output_tokens_below: int = Field(
        default=PolicyConfig.default_of("anomalous_output_tokens_below"), gt=0
    )
    relay_only_max_share: float = Field(
        default=PolicyConfig.default_of("relay_only_max_share"), ge=0, le=1
    )
    idle_relay_min_transfer_s: float | None = Field(
        default=PolicyConfig.default_of("idle_relay_min_transfer_s"),
        gt=0,
        description="an idle relay takes a transfer this long or longer; null: never",
    )
    md_recompute_max_tokens: int = Field(
        default=PolicyConfig.default_of("md_recompute_max_tokens"),
        ge=0,
        description="adaptive: the most prompt tokens MD may compute itself; 0: never",
    )
    traffic_window_s: float = Field(default=60.0, gt=0)
    retry_after_s: float = Field(default=PolicyConfig.default_of("retry_after_s"), gt=0)
    max_retries: int = Field(default=30, ge=0, description="a request refused this often is lost")


class HandoffSpec(_Spec):
    mode: Literal["auto", "one-shot", "catch-up"] = "auto"
    catchup_threshold: int = Field(default=64, ge=1)
    catchup_load_level: float = Field(default=0.5, ge=0, le=1)


class PoolSpec(_Spec):
    gpu: str
    instances: int = Field(gt=0)
    gpus_per_instance: int = Field(default=1, gt=0)
    max_batch: int = Field(default=64, gt=0, description="decode: sequences per batch")
    max_queue: int = Field(default=16, gt=0, description="prefill: requests queued per instance")
    max_num_batched_tokens: int = Field(default=8192, gt=0, description="prefill: tokens per step")
    cache_tokens: int | None = Field(
        default=None, ge=0, description="prefix cache per instance; default: its KV capacity"
    )


class SystemKind(StrEnum):
    SAME_DC = "same-dc"  # P and D in one datacenter, KV over RDMA
    NAIVE = "naive"  # P in A, D in B, full KV over the WAN, no decode-side cache
    PDD = "pdd"  # P and RLD in A, MD in B, DRC, the router's pipeline policy


class Ablation(StrEnum):
    NONE = "none"
    #: Not the router's policy: requests whose MD hit is below ``low_hit_below`` end at
    #: RLD (P-RLD), the "digest low-hit traffic locally" design the technique warns against.
    LOW_HIT_TO_RELAY = "low-hit-to-relay"


class SystemSpec(_Spec):
    kind: SystemKind
    prefill: PoolSpec
    decode: PoolSpec | None = Field(default=None, description="same-dc: the D pool")
    main: PoolSpec | None = Field(
        default=None, description="naive, pdd: the MD pool in datacenter B"
    )
    relay: PoolSpec | None = Field(default=None, description="pdd: the RLD pool in datacenter A")
    drc: bool | None = Field(
        default=None,
        description="decode-side prefix cache (DRC); default on for pdd and same-dc, off for "
        "naive (which then ships the full KV every time)",
    )
    ablation: Ablation = Ablation.NONE
    low_hit_below: float = Field(
        default=0.95,
        ge=0,
        le=1,
        description="low-hit-to-relay: the MD hit ratio that counts as low",
    )

    @model_validator(mode="after")
    def _pools_match_kind(self) -> SystemSpec:
        need = {
            SystemKind.SAME_DC: {"decode"},
            SystemKind.NAIVE: {"main"},
            SystemKind.PDD: {"main", "relay"},
        }[self.kind]
        have = {p for p in ("decode", "main", "relay") if getattr(self, p) is not None}
        if have != need:
            raise ValueError(
                f"a {self.kind.value} system has pools {sorted(need)}, got {sorted(have)}"
            )
        return self

    def pools(self) -> dict[str, PoolSpec]:
        return {
            name: pool
            for name in ("prefill", "relay", "decode", "main")
            if (pool := getattr(self, name)) is not None
        }

    @property
    def keeps_history(self) -> bool:
        return self.drc if self.drc is not None else self.kind != SystemKind.NAIVE

    @property
    def uses_wan(self) -> bool:
        return self.kind != SystemKind.SAME_DC


class RunSpec(_Spec):
    warmup_s: float = Field(default=0.0, ge=0, description="arrivals before this are not scored")
    drain_s: float = Field(default=600.0, ge=0, description="after the last arrival, stop waiting")
    sample_s: float = Field(default=10.0, gt=0, description="time-series bucket")


class GoodputSpec(_Spec):
    """Goodput = the highest arrival rate at which ``attainment`` of requests meet the SLO
    (DistServe's definition), found by bisection between ``rate_low`` and ``rate_high``."""

    attainment: float = Field(default=0.9, gt=0, le=1)
    rate_low: float = Field(gt=0)
    rate_high: float = Field(gt=0)
    probes: int = Field(default=6, ge=1)
    duration_s: float | None = Field(default=None, gt=0, description="default: the workload's")


class SweepSpec(_Spec):
    """The bathtub: rerun the systems with the generator's mean hit rate set to each value."""

    mean_hit_rates: tuple[float, ...] = Field(min_length=2)
    goodput_probes: int = Field(default=4, ge=1)


class Scenario(_Spec):
    name: str
    description: str = ""
    seed: int = 0
    model: ModelSpecFile
    gpus: dict[str, GpuSpec]
    wan: WanSpec
    in_dc: InDcSpec = InDcSpec()
    slo: SloSpec
    billing: BillingSpec = BillingSpec()
    router: RouterSpec = RouterSpec()
    handoff: HandoffSpec = HandoffSpec()
    block_size: int | None = Field(default=None, gt=0, description="default: the workload's")
    workload: WorkloadSpec
    systems: dict[str, SystemSpec] = Field(min_length=1)
    run: RunSpec = RunSpec()
    goodput: GoodputSpec | None = None
    sweep: SweepSpec | None = None
    premium_range: tuple[float, float] | None = Field(
        default=None,
        description="GPU-B price premiums over GPU-A at which to tabulate pdd's cost saving "
        "over baseline (needs gpus A and B and systems baseline and pdd)",
    )

    @model_validator(mode="after")
    def _references_resolve(self) -> Scenario:
        for sname, system in self.systems.items():
            for pname, pool in system.pools().items():
                if pool.gpu not in self.gpus:
                    raise ValueError(
                        f"systems.{sname}.{pname}.gpu {pool.gpu!r} is not one of the gpus "
                        f"{sorted(self.gpus)}"
                    )
        if self.premium_range is not None:
            missing = [f"gpus.{g}" for g in ("A", "B") if g not in self.gpus]
            missing += [f"systems.{n}" for n in ("baseline", "pdd") if n not in self.systems]
            if missing:
                raise ValueError(f"premium_range needs {', '.join(missing)}; or drop it")
        if self.sweep is not None and self.workload.kind != "generator":
            raise ValueError("sweep needs a generator workload (it sets its mean hit rate)")
        return self

    def shape(self, pool: PoolSpec) -> InstanceShape:
        return InstanceShape(
            self.gpus[pool.gpu].build(pool.gpu), pool.gpus_per_instance, self.model.build()
        )


def shipped_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def load_scenario(name_or_path: str, traces: Path | None = None) -> tuple[Scenario, Path]:
    """A shipped scenario by name, or a YAML file; returns it and the folder relative
    trace paths in it resolve against: ``traces`` when given, else the trace sample
    committed at ``bench/traces/`` for a shipped scenario (its paths name a format's
    folder, ``claude-code`` or ``mooncake/conversation_trace.jsonl``, so ``traces`` may
    be a folder of the full published traces laid out the same way), else the file's
    own folder.

    A document may say ``extends: NAME`` to start from another scenario and override
    only what differs: mappings merge key by key, anything else is replaced, and
    ``systems`` is always replaced whole (a scenario compares the systems it names), as
    is a ``workload`` that names its ``kind``."""
    path = _scenario_path(name_or_path)
    doc = _read(path)
    try:
        scenario = Scenario.model_validate(doc)
    except ValidationError as exc:
        raise ScenarioError(f"{path}: invalid scenario\n{_errors(exc)}") from exc
    if traces is not None:
        return scenario, traces
    return scenario, BUNDLED_TRACES if path.parent == SCENARIO_DIR else path.parent


def _scenario_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix or path.exists():
        return path
    path = SCENARIO_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ScenarioError(
            f"no scenario {name_or_path!r}: shipped ones are {shipped_scenarios()}, "
            "or give a path to a .yaml file"
        )
    return path


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The YAML document with its ``extends`` chain merged in."""
    if path in seen:
        raise ScenarioError(f"{path}: 'extends' loops back to itself")
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: cannot read the scenario ({exc})") from exc
    if not isinstance(doc, dict):
        raise ScenarioError(f"{path}: a scenario is a YAML mapping")
    base = doc.pop("extends", None)
    if base is None:
        return doc
    return _merge(_read(_scenario_path(str(base)), (*seen, path)), doc, top=True)


def _merge(base: dict, override: dict, top: bool = False) -> dict:
    merged = dict(base)
    for key, value in override.items():
        whole = top and (key == "systems" or (key == "workload" and "kind" in value))
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and not whole:
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"])
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)
