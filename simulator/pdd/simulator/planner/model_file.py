"""The planner's model of a live deployment, read from a scenario file without the
simulator's scenario loader.

The operator runs the planner loop (:mod:`pdd.simulator.planner.planner`) beside kopf,
and the operator may not import the router or the trace readers, which the scenario
loader (:mod:`pdd.simulator.scenario`) does. So this reads only what the capacity model
needs from the same YAML (``model:``, ``gpus:``, one PDD system's pools, the router's
``ttft_budget_s``) into :mod:`pdd.simulator.hardware`'s types, and takes the line from the
PDDDeployment (``spec.wan``), which is what the live deployment runs on. A test checks it
gives the same :class:`DeploymentModel` as the loader for every shipped PDD system.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pdd.simulator.hardware import Efficiency, GpuType, HardwareError, InstanceShape, ModelSpec
from pdd.simulator.planner.capacity import DeploymentModel, PoolModel
from pdd.simulator.planner.load import LoadError

#: The shipped scenarios (``pdd simulate --list``), where a bare name is looked up.
SCENARIO_DIR = Path(__file__).resolve().parents[1] / "scenarios"
#: The router's default TTFT budget (``PolicyConfig.ttft_budget_s``), for a file that sets none.
DEFAULT_TTFT_BUDGET_S = 2.0
#: A pool's defaults where the file leaves them out (the scenario's ``PoolSpec``).
DEFAULT_MAX_BATCH = 64
DEFAULT_CHUNK_TOKENS = 8192
PDD_POOL_NAMES = ("prefill", "relay", "main")


def scenario_path(name_or_path: str) -> Path:
    """A shipped scenario's file by name, or the path itself."""
    shipped = SCENARIO_DIR / f"{name_or_path}.yaml"
    return shipped if shipped.is_file() else Path(name_or_path)


def _section(doc: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = doc.get(key)
    if not isinstance(value, dict):
        raise LoadError(f"{where}: no {key!r} mapping")
    return value


def _gpu(name: str, fields: dict[str, Any]) -> GpuType:
    fields = dict(fields)
    efficiency = Efficiency(**fields.pop("efficiency", {}))
    return GpuType(name=name, efficiency=efficiency, **fields)


def _pool(pool: dict[str, Any], gpus: dict[str, GpuType], model: ModelSpec) -> PoolModel:
    gpu = gpus.get(pool.get("gpu", ""))
    if gpu is None:
        raise LoadError(f"pool names gpu {pool.get('gpu')!r}, not one of {sorted(gpus)}")
    shape = InstanceShape(gpu, int(pool.get("gpus_per_instance", 1)), model)
    return PoolModel(
        shape,
        int(pool.get("max_batch", DEFAULT_MAX_BATCH)),
        int(pool.get("max_num_batched_tokens", DEFAULT_CHUNK_TOKENS)),
    )


def parse_model(
    doc: dict[str, Any], system: str, line_gbps: float, rtt_s: float
) -> DeploymentModel:
    """The PDD ``system`` of a scenario document, on a line of ``line_gbps`` and ``rtt_s``."""
    if "extends" in doc:
        raise LoadError("the planner reads a scenario without 'extends': write it out in full")
    try:
        model = ModelSpec(**_section(doc, "model", "scenario"))
        gpus = {name: _gpu(name, f) for name, f in _section(doc, "gpus", "scenario").items()}
        spec = _section(_section(doc, "systems", "scenario"), system, "systems")
        if spec.get("kind") != "pdd":
            raise LoadError(f"systems.{system} is a {spec.get('kind')!r} system, not pdd")
        pools = {name: _pool(_section(spec, name, system), gpus, model) for name in PDD_POOL_NAMES}
    except (TypeError, HardwareError) as exc:
        raise LoadError(f"scenario: {exc}") from None
    router = doc.get("router") or {}
    return DeploymentModel(
        pools=pools,
        kv_bytes_per_token=model.kv_bytes_per_token,
        line_gbps=line_gbps,
        rtt_s=rtt_s,
        ttft_budget_s=float(router.get("ttft_budget_s", DEFAULT_TTFT_BUDGET_S)),
    )


def load_model(
    name_or_path: str, line_gbps: float, rtt_s: float, system: str = "pdd"
) -> DeploymentModel:
    """:func:`parse_model` of a shipped scenario's name or a YAML file; LoadError says why not."""
    path = scenario_path(name_or_path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise LoadError(f"planner scenario {name_or_path!r}: {exc}") from None
    if not isinstance(doc, dict):
        raise LoadError(f"planner scenario {name_or_path!r} is not a YAML mapping")
    return parse_model(doc, system, line_gbps, rtt_s)
