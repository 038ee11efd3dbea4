"""Spec validation: everything is checked before anything is created.

The CRD's schema and CEL rules refuse most mistakes at admission. This module repeats
the same rules (and the schema's types and ranges, through the models) because the
operator must not trust that admission ran: an old CRD, an emulator, or a CR written
before a rule existed all reach the handlers. Every message says what to change.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity
from pydantic import ValidationError

from pdd.operator.spec import TRACING_ENDPOINT_PATTERN, PDDSpec, Resources

#: Child names append up to 22 characters ("-shared-secret") to the PDDDeployment's
#: name and Service names must stay DNS labels (<= 63); 40 leaves room for the role.
MAX_NAME_LENGTH = 40


class InvalidSpecError(ValueError):
    """A PDDDeployment spec that cannot be deployed; ``problems`` each carry the fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def parse_spec(raw: dict[str, Any], name: str) -> PDDSpec:
    """Parse and fully validate a CR's spec, or raise InvalidSpecError with every problem."""
    problems = name_problems(name)
    try:
        spec = PDDSpec.model_validate(raw)
    except ValidationError as exc:
        raise InvalidSpecError(problems + [_describe(err) for err in exc.errors()]) from None
    problems += spec_problems(spec)
    if problems:
        raise InvalidSpecError(problems)
    return spec


def name_problems(name: str) -> list[str]:
    if len(name) > MAX_NAME_LENGTH:
        return [
            f"metadata.name {name!r} has {len(name)} characters; use at most "
            f"{MAX_NAME_LENGTH} so that child object names stay valid DNS labels"
        ]
    return []


def spec_problems(spec: PDDSpec) -> list[str]:
    """The cross-field rules (the CRD's x-kubernetes-validations, one message each)."""
    problems: list[str] = []
    relay = spec.relay
    if relay.max_replicas < relay.min_replicas:
        problems.append(
            f"relay.maxReplicas ({relay.max_replicas}) is below minReplicas "
            f"({relay.min_replicas}); raise maxReplicas or lower minReplicas"
        )
    if (spec.pool_b is None) == (spec.remote_cluster is None):
        problems.append(
            "set exactly one of poolB (MD on a node pool of this cluster) or remoteCluster "
            "(MD in cluster B, reached through a kubeconfig Secret)"
        )
    source = spec.model.source
    given = [n for n, v in (("pvc", source.pvc), ("hostPath", source.host_path),
                            ("image", source.image), ("huggingFace", source.hugging_face))
             if v is not None]  # fmt: skip
    if len(given) != 1:
        problems.append(
            "model.source needs exactly one of pvc, hostPath, image or huggingFace; "
            f"got {given or 'none'}"
        )
    router = spec.router
    if router.managed_redis and router.redis_url is not None:
        problems.append(
            "router.redisUrl and router.managedRedis are both set; use one: an external "
            "Redis URL, or managedRedis: true for a Redis the operator runs"
        )
    if router.replicas > 1 and not spec.redis_enabled:
        problems.append(
            f"router.replicas ({router.replicas}) > 1 needs shared state: set "
            "router.redisUrl or router.managedRedis: true, or use one router replica"
        )
    tls = spec.wan.tls
    if tls.secret_name is not None and not tls.enabled:
        problems.append(
            "wan.tls.secretName is set but wan.tls.enabled is false; set enabled: true to use "
            "the Secret, or drop secretName"
        )
    problems += _planner_problems(spec)
    problems += _tracing_problems(spec)
    problems += _anomalous_threshold_problems(spec)
    problems += _engine_fit_problems(spec)
    problems += vllm_problems(spec)
    problems += _resource_problems(spec)
    return problems


def _planner_problems(spec: PDDSpec) -> list[str]:
    """The planner needs its targets, and each role's bounds in order."""
    planner, problems = spec.planner, []
    if planner.enabled and (spec.slo.ttft_p90_seconds is None or spec.slo.itl_p90_seconds is None):
        problems.append(
            "planner.enabled needs slo.ttftP90Seconds and slo.itlP90Seconds: the targets "
            "it sizes for"
        )
    for field, pool in (("prefill", planner.prefill), ("relay", planner.relay),
                        ("mainDecode", planner.main_decode)):  # fmt: skip
        if pool.max_replicas < pool.min_replicas:
            problems.append(
                f"planner.{field}.maxReplicas is below minReplicas "
                f"({pool.max_replicas} < {pool.min_replicas})"
            )
    return problems


def _tracing_problems(spec: PDDSpec) -> list[str]:
    """An endpoint every pod's exporter can reach (the pods would refuse to start)."""
    tracing = spec.observability.tracing
    if tracing is None or re.fullmatch(TRACING_ENDPOINT_PATTERN, tracing.endpoint):
        return []
    return [
        f"observability.tracing.endpoint must be an http:// or https:// URL with a host, "
        f"not {tracing.endpoint!r}"
    ]


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


def _engine_fit_problems(spec: PDDSpec) -> list[str]:
    """Engine settings that cannot work on the model or the chips the spec names: refused
    here, with the field to change, rather than found by a pod that cannot start."""
    context = spec.model.config.max_position_embeddings if spec.model.config else None
    roles = (
        ("prefill", spec.prefill.engine, spec.pool_a),
        ("relay", spec.relay.engine, spec.pool_a),
        ("mainDecode", spec.main_decode.engine, spec.main_pool),
    )
    problems = []
    for name, own, pool in roles:
        settings = own.over(spec.engine)
        prompt = settings.max_prompt_tokens
        if context is not None and prompt is not None and prompt >= context:
            problems.append(
                f"{name}: maxPromptTokens ({prompt}) must be below the model's context "
                f"(model.config.maxPositionEmbeddings = {context}); lower maxPromptTokens"
            )
        gpu, kv = pool.gpu_type, settings.kv_cache_gib
        memory = gpu.memory_gib if gpu is not None else None
        if gpu is not None and memory is not None and kv is not None and kv >= memory:
            problems.append(
                f"{name}: kvCacheGiB ({kv:g}) does not fit one GPU of its pool "
                f"({gpu.value}, {memory:g} GiB, and the weights need room too); "
                "lower kvCacheGiB or use kvCacheMemoryFraction"
            )
    return problems


def vllm_problems(spec: PDDSpec) -> list[str]:
    """Roles on vLLM (``engineType: vllm``): an image to run, and no setting the vLLM
    worker would refuse at start (it exits 2 on them) or that vLLM cannot honour."""
    problems = []
    for name, role in spec.worker_roles.items():
        if role.engine_type != "vllm":
            if role.vllm is not None:
                problems.append(
                    f"{name}: vllm settings are set but engineType is pdd; set "
                    f"{name}.engineType: vllm or drop {name}.vllm"
                )
            continue
        if spec.images.vllm_worker is None:
            problems.append(
                f"{name}.engineType is vllm but images.vllmWorker is not set; name the vLLM "
                "worker image (docker buildx bake worker-vllm)"
            )
        problems += _vllm_role_problems(spec, name)
    return problems


def _vllm_role_problems(spec: PDDSpec, name: str) -> list[str]:
    """One vLLM role's settings against its engine settings and its pod's GPUs. (A vLLM
    setting that has a twin in ``engine``, gpuMemoryUtilization and kvCacheGiB included,
    is a flag, which the worker takes over the config document's: no conflict.)"""
    role = spec.worker_roles[name]
    engine = role.engine.over(spec.engine)
    vllm = role.vllm
    problems = []
    if engine.max_prompt_tokens is not None:
        problems.append(
            f"{name}: maxPromptTokens is the pdd engine's setting and vLLM has none "
            f"({name}.engineType is vllm); drop it from engine and {name}.engine (set it on "
            "the pdd roles' own engine; vLLM takes prompts up to maxModelLen less one token)"
        )
    if vllm is None:
        return problems
    gpus = _gpus(spec.container_resources[name])
    parallel = vllm.tensor_parallel_size
    if parallel is not None and gpus is not None and parallel > gpus:
        problems.append(
            f"{name}: vllm.tensorParallelSize ({parallel}) needs that many GPUs in each pod, "
            f"and its resources give {gpus}; raise the GPU limit or lower tensorParallelSize"
        )
    return problems


def _gpus(resources: Resources) -> int | None:
    """The GPUs a container's limits give (an extended resource named ``*/gpu``), if any."""
    counts = [Decimal(parse_quantity(v)) for k, v in resources.limits.items()
              if _extended(k) and k.endswith("/gpu")]  # fmt: skip
    return int(sum(counts)) if counts else None


def _anomalous_threshold_problems(spec: PDDSpec) -> list[str]:
    """The anomalous filter takes prompts from minInputTokens up; the router refuses prompts
    above the prefill's maxPromptTokens, so the first must be below the second."""
    limit = spec.prefill.engine.over(spec.engine).max_prompt_tokens
    threshold = spec.anomalous_traffic.min_input_tokens
    if limit is None or limit > threshold:
        return []
    return [
        f"anomalousTraffic.minInputTokens must be below the prefill's maxPromptTokens "
        f"({threshold} >= {limit}): the router refuses longer prompts, so the anomalous "
        "filter would never fire; lower anomalousTraffic.minInputTokens or raise maxPromptTokens"
    ]


def _describe(error: Any) -> str:
    """A pydantic error as 'spec.path.to.field: what is wrong'."""
    path = ".".join(str(part) for part in error["loc"])
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        message = "unknown field (check the spelling against `kubectl explain pdddeployment.spec`)"
    return f"spec.{path}: {message}"
