"""Spec validation: everything is checked before anything is created.

The CRD's schema and CEL rules refuse most mistakes at admission. The operator checks them
again because it must not trust that admission ran (an old CRD, an emulator, a CR written
before a rule existed all reach the handlers), and from the same declarations: the schema's
types and ranges are the models' own (``pdd.operator.spec``), and the CEL rules are read
back from the generated CRD and run on the spec as the API server would have defaulted it
(``pdd.operator.cel``). This module adds only what the CRD cannot say: resource quantities
read and compared as the API server reads them (a role's over its pool's, key by key, which
CEL can neither merge nor parse), and the GPUs they give against vLLM's tensor parallelism.
Every message says what to change.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity
from pydantic import ValidationError

from pdd.operator import cel
from pdd.operator.crd import openapi_schema
from pdd.operator.spec import PDDSpec, Resources


class InvalidSpecError(ValueError):
    """A PDDDeployment spec that cannot be deployed; ``problems`` each carry the fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def parse_spec(raw: dict[str, Any], name: str) -> PDDSpec:
    """Parse and fully validate a CR's spec, or raise InvalidSpecError with every problem."""
    metadata = {"name": name}
    try:
        spec = PDDSpec.model_validate(raw)
    except ValidationError as exc:
        problems = admission_problems({"metadata": metadata})
        raise InvalidSpecError(problems + [_describe(err) for err in exc.errors()]) from None
    problems = admission_problems({"metadata": metadata, "spec": defaulted(spec)})
    problems += spec_problems(spec)
    if problems:
        raise InvalidSpecError(problems)
    return spec


def defaulted(spec: PDDSpec) -> dict[str, Any]:
    """The spec as the API server stores it: every default filled in, unset fields absent."""
    return spec.model_dump(by_alias=True, exclude_none=True, mode="json")


def admission_problems(obj: dict[str, Any]) -> list[str]:
    """The CRD's CEL rules that ``obj`` (metadata, and the defaulted spec) breaks."""
    return cel.failures(openapi_schema(), obj)


def spec_problems(spec: PDDSpec) -> list[str]:
    """What the CRD's rules cannot check (see each function)."""
    return _tensor_parallel_problems(spec) + _resource_problems(spec)


def _resource_problems(spec: PDDSpec) -> list[str]:
    """What the API server would refuse in a container's resources, found before any
    Deployment is written: a negative quantity, a request above its limit, a fractional
    or limitless extended resource (a GPU cannot be shared or overcommitted)."""
    return [
        problem
        for role, resources in spec.container_resources.items()
        for problem in container_resource_problems(role, resources)
    ]


def container_resource_problems(role: str, resources: Resources) -> list[str]:
    """One container's resources checked as the API server checks a pod's."""
    problems = []
    where = f"{role} resources (the role's over its pool's)"
    values = {part: {k: Decimal(parse_quantity(v)) for k, v in getattr(resources, part).items()}
              for part in ("requests", "limits")}  # fmt: skip
    for part, amounts in values.items():
        for name, amount in amounts.items():
            if amount < 0:
                problems.append(f"{where}: {part}.{name} is negative; use a quantity >= 0")
            elif _extended(name) and amount != amount.to_integral_value():
                problems.append(
                    f"{where}: {part}.{name} ({getattr(resources, part)[name]}) must be a whole "
                    "number: an extended resource such as a GPU is not divisible"
                )
    requests, limits = values["requests"], values["limits"]
    for name, amount in requests.items():
        if name in limits and amount > limits[name]:
            problems.append(
                f"{where}: requests.{name} ({resources.requests[name]}) is above "
                f"limits.{name} ({resources.limits[name]}); a request must be <= its limit"
            )
        elif _extended(name) and limits.get(name) != amount:
            problems.append(
                f"{where}: requests.{name} needs an equal limits.{name}: extended resources "
                "cannot be overcommitted (or set only limits, the usual way for GPUs)"
            )
    return problems


def _extended(name: str) -> bool:
    """An extended resource (nvidia.com/gpu): a domain-prefixed name outside kubernetes.io."""
    domain, slash, _ = name.partition("/")
    return bool(slash) and not domain.endswith("kubernetes.io")


def _tensor_parallel_problems(spec: PDDSpec) -> list[str]:
    """vLLM's tensor parallelism within the GPUs each of its pods gets (the role's resources
    over its pool's): vLLM would fail at start. (The rest of what a vLLM role needs is in
    the CRD's CEL rules.)"""
    problems = []
    for name, role in spec.worker_roles.items():
        parallel = role.vllm.tensor_parallel_size if role.vllm is not None else None
        gpus = _gpus(spec.container_resources[name])
        if role.engine_type == "vllm" and parallel and gpus is not None and parallel > gpus:
            problems.append(
                f"{name}: vllm.tensorParallelSize ({parallel}) needs that many GPUs in each "
                f"pod, and its resources give {gpus}; raise the GPU limit or lower "
                "tensorParallelSize"
            )
    return problems


def _gpus(resources: Resources) -> int | None:
    """The GPUs a container's limits give (an extended resource named ``*/gpu``), if any."""
    counts = [Decimal(parse_quantity(v)) for k, v in resources.limits.items()
              if _extended(k) and k.endswith("/gpu")]  # fmt: skip
    return int(sum(counts)) if counts else None


def _describe(error: Any) -> str:
    """A pydantic error as 'spec.path.to.field: what is wrong'."""
    path = ".".join(str(part) for part in error["loc"])
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        message = "unknown field (check the spelling against `kubectl explain pdddeployment.spec`)"
    return f"spec.{path}: {message}"
