"""The PDDDeployment spec as typed, frozen models.

The CRD (crds/pdddeployments.yaml) is what users and ``kubectl explain`` see; these
models are what the operator reads. They carry the same field names and defaults so
that a CR behaves the same whether the API server applied the schema defaults (a real
cluster) or not (an emulator, an old object): tests check the two agree field by field.
Cross-field rules live in ``validation.py``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from pdd.common.config_document import EngineSettings
from pdd.common.kv_codec import MD_RECOMPUTE_MAX_TOKENS, NO_CODEC, KVCodecSetting
from pdd.common.model_store import hub_repo_problem


class _Spec(BaseModel):
    """Base for every spec section: camelCase on the wire, immutable, no unknown keys."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, frozen=True, extra="forbid"
    )


class PvcSource(_Spec):
    claim_name: str = Field(min_length=1)
    sub_path: str | None = None


class HostPathSource(_Spec):
    path: str = Field(min_length=1)


class ImageSource(_Spec):
    path: str = Field(min_length=1)


class TokenSecretRef(_Spec):
    name: str = Field(min_length=1)
    key: str = "token"


def _hub_repo(repo: str) -> str:
    """The id ``pdd models pull`` takes (huggingface_hub's rules), refused at admission
    rather than in every pod's init container."""
    problem = hub_repo_problem(repo)
    if problem is not None:
        raise ValueError(problem)
    return repo


class HuggingFaceSource(_Spec):
    """A Hub repo each pod's init container pulls (``pdd models pull``) before it starts."""

    repo: Annotated[str, AfterValidator(_hub_repo)] = Field(pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    revision: str = "main"
    token_secret: TokenSecretRef | None = None
    #: Another hub (a mirror, a private one): the pull's HF_ENDPOINT.
    endpoint: str | None = None
    #: A PVC to pull into (kept across restarts, shared by the pods that mount it);
    #: none: an emptyDir per pod.
    claim_name: str | None = None


class ModelSource(_Spec):
    """Where the checkpoint lives; exactly one of the four (checked in validation)."""

    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None
    image: ImageSource | None = None
    hugging_face: HuggingFaceSource | None = None


KVDtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8"]


class ModelShape(_Spec):
    """The few config.json fields that size the KV cache (the operator can't read weights)."""

    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0, alias="numKVHeads")
    head_dim: int = Field(gt=0)
    dtype: KVDtype = "bfloat16"
    #: The model's context, where known: bounds maxPromptTokens.
    max_position_embeddings: int | None = Field(default=None, gt=0)


class ModelSpec(_Spec):
    source: ModelSource
    served_name: str = Field(min_length=1)
    mount_path: str = "/models"
    kv_bytes_per_token: int | None = Field(default=None, gt=0)
    config: ModelShape | None = None


class Images(_Spec):
    worker: str = Field(min_length=1)
    router: str = Field(min_length=1)
    #: The vLLM worker image (``docker buildx bake worker-vllm``: vLLM's CUDA build and
    #: PDD), which the roles whose ``engineType`` is ``vllm`` run.
    vllm_worker: str | None = Field(default=None, min_length=1)
    redis: str = "redis:7.4-alpine"
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    pull_secrets: list[str] = Field(default_factory=list)


#: A resource quantity as the API server reads one (the pattern of its OpenAPI ``Quantity``):
#: ``8``, ``500m``, ``64Gi``, ``1e3``. The CRD's schema carries the same pattern.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not re.fullmatch(QUANTITY_PATTERN, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 2, 500m, 16Gi)")
    return value


Quantity = Annotated[int | str, AfterValidator(_quantity)]


class Resources(_Spec):
    """A container's requests and limits (``{cpu: "4", memory: 16Gi, nvidia.com/gpu: 1}``).

    A role's resources lie over its pool's key by key (the pool names the GPUs, the role
    its CPU and memory); ``validation.py`` checks the result as the API server would."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)

    def over(self, base: Resources) -> Resources:
        """These resources over ``base``, key by key within requests and within limits."""
        return Resources(
            requests={**base.requests, **self.requests}, limits={**base.limits, **self.limits}
        )

    def manifest(self) -> dict[str, Any]:
        """A container's ``resources``: the parts that are set."""
        return {part: dict(v) for part, v in (("requests", self.requests),
                                             ("limits", self.limits)) if v}  # fmt: skip


#: Each worker pod's CPU and memory unless its role says otherwise: room for the engine's
#: host-side work and the tokenizer; no CPU limit (throttling stalls decode steps), and a
#: memory limit well above the request (weights pass through host memory while loading).
WORKER_RESOURCES = Resources(requests={"cpu": "4", "memory": "16Gi"}, limits={"memory": "64Gi"})
#: The router's: tokenizing prompts is its main CPU work.
ROUTER_RESOURCES = Resources(requests={"cpu": "1", "memory": "1Gi"}, limits={"memory": "4Gi"})


def _default(resources: Resources) -> Any:
    return Field(default_factory=lambda: resources)


class GpuType(_Spec):
    label_key: str = "nvidia.com/gpu.product"
    value: str = Field(min_length=1)
    #: One GPU's memory, where known: bounds kvCacheGiB.
    memory_gib: float | None = Field(default=None, gt=0, alias="memoryGiB")


class Pool(_Spec):
    """A node pool: where a role's pods may run and what each pod asks for."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources)
    gpu_type: GpuType | None = None

    def node_selector_with_gpu(self) -> dict[str, str]:
        """The node selector plus the GPU type label, which is how pools differ by chip."""
        selector = dict(self.node_selector)
        if self.gpu_type is not None:
            selector[self.gpu_type.label_key] = self.gpu_type.value
        return selector


#: The inference engine of a worker role: PDD's own, or vLLM's (``pdd worker --engine``).
EngineType = Literal["pdd", "vllm"]
#: vLLM's KV cache dtypes a PDD connector can carry (``--kv-cache-dtype``).
VllmKVCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]


class VllmSettings(_Spec):
    """vLLM's own settings of a role whose ``engineType`` is ``vllm``, by vLLM's names; the
    operator renders each one set into the role's ``pdd worker`` flags (vLLM's flag names),
    which win over the same setting in the role's ``engine``. Unset: vLLM's default."""

    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    kv_cache_dtype: VllmKVCacheDtype | None = None
    #: No CUDA graphs or compiled model: a faster start, slower steps.
    enforce_eager: bool | None = None


class WorkerRole(_Spec):
    """What every worker role has: its engine, its engine's settings and its resources."""

    engine_type: EngineType = "pdd"
    engine: EngineSettings = Field(default_factory=EngineSettings)
    vllm: VllmSettings | None = None
    resources: Resources = _default(WORKER_RESOURCES)


class RoleReplicas(WorkerRole):
    replicas: int = Field(default=1, ge=0)


class Relay(WorkerRole):
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=4, ge=1)
    target_load: float = Field(default=0.7, gt=0, le=1)


class SecretKeyRef(_Spec):
    name: str = Field(min_length=1)
    key: str = "kubeconfig"


class RemoteCluster(_Spec):
    kubeconfig_secret: SecretKeyRef
    namespace: str | None = None
    service_domain: str = "clusterset.local"
    main_decode_host: str | None = None
    pool: Pool = Field(default_factory=Pool)


class WanTls(_Spec):
    """TLS on the data channels that cross the WAN (P -> MD KV, MD <-> RLD handoff)."""

    enabled: bool = False
    #: A Secret in each cluster with ``tls.crt``/``tls.key``/``ca.crt`` (cert-manager's
    #: layout); None: the operator generates a CA and a certificate once.
    secret_name: str | None = Field(default=None, min_length=1)


class Wan(_Spec):
    declared_gbps: float = Field(gt=0)
    rtt_ms: float = Field(default=30.0, ge=0)
    tls: WanTls = Field(default_factory=WanTls)
    #: How P codes the KV it sends MD across the WAN (lossy but for ``none``).
    kv_codec: KVCodecSetting = NO_CODEC
    #: The most prompt tokens MD may compute itself where that is sooner than its KV's
    #: crossing (the router's ``--md-recompute-max-tokens``); 0: never.
    md_recompute_max_tokens: int = Field(default=MD_RECOMPUTE_MAX_TOKENS, ge=0)


class Workload(_Spec):
    request_rate: float = Field(ge=0)
    mean_input_tokens: float = Field(ge=0)
    mean_output_tokens: float = Field(ge=0)
    mean_md_hit_rate: float = Field(ge=0, le=1, alias="meanMDHitRate")


class Slo(_Spec):
    ttft_p99_ms: float = Field(default=5000.0, gt=0)
    tpot_ms: float = Field(default=50.0, gt=0)
    #: The planner's targets: client-side TTFT (queue time included) and ITL, P90.
    ttft_p90_seconds: float | None = Field(default=None, gt=0)
    itl_p90_seconds: float | None = Field(default=None, gt=0)


class PlannerPool(_Spec):
    """What the planner may buy of one worker role: its price and its bounds."""

    #: $ per replica-hour; None: all replicas of every role cost the same.
    cost_per_hour: float | None = Field(default=None, ge=0)
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=16, ge=1)


class Planner(_Spec):
    """The SLO planner: P, RLD and MD sized for ``slo``'s P90 targets at least cost, each
    through its own HPA on ``pdd_planner_desired_replicas{role}``. Off: the relay's HPA on
    relay load, and P and MD at their fixed ``replicas``."""

    enabled: bool = False
    interval_seconds: int = Field(default=60, ge=10)
    predictor: Literal["last", "trend"] = "trend"
    prefill: PlannerPool = Field(default_factory=PlannerPool)
    relay: PlannerPool = Field(default_factory=PlannerPool)
    main_decode: PlannerPool = Field(default_factory=PlannerPool)


class ApiKeysSecret(_Spec):
    """A Secret of the router's namespace holding the client API keys the router accepts."""

    name: str = Field(min_length=1)
    key: str = Field(default="api-keys", min_length=1)


class Router(_Spec):
    replicas: int = Field(default=1, ge=1)
    api_keys_secret: ApiKeysSecret | None = None
    redis_url: str | None = None
    managed_redis: bool = False
    resources: Resources = _default(ROUTER_RESOURCES)


class Handoff(_Spec):
    policy: Literal["auto", "oneShot", "catchUp"] = "auto"
    catch_up_threshold: int = Field(default=64, ge=1)


class AnomalousTraffic(_Spec):
    min_input_tokens: int = Field(default=32768, ge=1)
    max_output_tokens: int = Field(default=500, ge=1)


#: An OTLP endpoint as the CRD's CEL rule reads one: http(s), a host, then anything.
TRACING_ENDPOINT_PATTERN = r"https?://[^/?#\s]+([/?#].*)?"


class Tracing(_Spec):
    """OpenTelemetry spans from every pod (docs/tracing.md): where they go, how many."""

    endpoint: str = Field(min_length=1)
    #: The share of requests traced (``parentbased_traceidratio``).
    sample_ratio: float = Field(default=1.0, ge=0, le=1)


class Observability(_Spec):
    tracing: Tracing | None = None


class PDDSpec(_Spec):
    """The whole ``spec`` of a PDDDeployment."""

    model: ModelSpec
    images: Images
    pool_a: Pool = Field(default_factory=Pool)
    prefill: RoleReplicas = Field(default_factory=RoleReplicas)
    relay: Relay = Field(default_factory=Relay)
    pool_b: Pool | None = None
    remote_cluster: RemoteCluster | None = None
    main_decode: RoleReplicas = Field(default_factory=RoleReplicas)
    wan: Wan
    workload: Workload | None = None
    slo: Slo = Field(default_factory=Slo)
    planner: Planner = Field(default_factory=Planner)
    router: Router = Field(default_factory=Router)
    handoff: Handoff = Field(default_factory=Handoff)
    anomalous_traffic: AnomalousTraffic = Field(default_factory=AnomalousTraffic)
    observability: Observability = Field(default_factory=Observability)
    #: Engine settings every worker role shares; each role's ``engine`` overrides them.
    engine: EngineSettings = Field(default_factory=EngineSettings)
    #: How long a worker pod told to stop may take to finish what it runs.
    drain_seconds: int = Field(default=30, ge=0)
    #: How long a worker pod may take from start to serving (loading the model) before
    #: kubelet restarts it: its startup probe's budget.
    startup_seconds: int = Field(default=900, ge=10)

    @property
    def main_pool(self) -> Pool:
        """The pool MD runs on: pool B, or the remote cluster's pool."""
        if self.remote_cluster is not None:
            return self.remote_cluster.pool
        return self.pool_b if self.pool_b is not None else Pool()

    @property
    def container_resources(self) -> dict[str, Resources]:
        """Each role's container resources by its spec field: a worker role's over its pool's."""
        return {
            "prefill": self.prefill.resources.over(self.pool_a.resources),
            "relay": self.relay.resources.over(self.pool_a.resources),
            "mainDecode": self.main_decode.resources.over(self.main_pool.resources),
            "router": self.router.resources,
        }

    @property
    def worker_roles(self) -> dict[str, WorkerRole]:
        """Each worker role's section by its spec field."""
        return {"prefill": self.prefill, "relay": self.relay, "mainDecode": self.main_decode}

    @property
    def redis_enabled(self) -> bool:
        return self.router.managed_redis or self.router.redis_url is not None
