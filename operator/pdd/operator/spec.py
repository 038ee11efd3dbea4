"""The PDDDeployment spec as typed, frozen models: the one declaration of its schema.

The CRD (crds/pdddeployments.yaml, ``pdd operator crd``) is generated from these models:
each field's type, bounds, default and docstring (its ``kubectl explain`` text), and the CEL
rules (``x-kubernetes-validations``) declared beside the fields they constrain, which the
API server runs at admission and the operator runs again (``validation.py``). So a CR behaves
the same whether the API server applied the schema (a real cluster) or not (an emulator, an
old object). Cross-field rules live in ``spec_rules.py``; what CEL cannot express (resource
quantities merged and compared as the API server does) lives in ``validation.py``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from pdd.common.config_document import EngineSettings, SloSection, WanKVSettings
from pdd.common.model_store import hub_repo_problem
from pdd.operator.cel import PATH, Rule, validations
from pdd.operator.spec_rules import SPEC_RULES


class _Spec(BaseModel):
    """Base for every spec section: camelCase on the wire, immutable, no unknown keys, and
    each field's docstring its description in the CRD."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
    )


class PvcSource(_Spec):
    claim_name: str = Field(min_length=1)
    """Name of the PVC in the pod's namespace."""
    sub_path: str | None = None
    """Directory inside the volume that holds config.json and the weights."""


class HostPathSource(_Spec):
    path: str = Field(min_length=1)
    """Absolute directory on the node."""


class ImageSource(_Spec):
    path: str = Field(min_length=1)
    """Directory inside the worker image."""


class TokenSecretRef(_Spec):
    name: str = Field(min_length=1)
    """Secret name."""
    key: str = "token"
    """Key in the Secret's data holding the token."""


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
    """ORG/NAME on the hub."""
    revision: str = "main"
    """Branch, tag or commit."""
    token_secret: TokenSecretRef | None = None
    """Secret holding the hub token (HF_TOKEN) for private or gated repos."""
    endpoint: str | None = None
    """Another hub's URL (a mirror); the pull's HF_ENDPOINT."""
    claim_name: str | None = None
    """A PVC to pull into, kept across restarts (ReadWriteMany when pods on several nodes share it);
    without it each pod pulls into an emptyDir."""


class ModelSource(_Spec):
    """Where the checkpoint lives: exactly one of the four."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            Rule(
                "(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.image) ? 1 : 0)"
                " + (has(self.huggingFace) ? 1 : 0) == 1",
                "model.source needs exactly one of pvc, hostPath, image or huggingFace",
            )
        )
    )

    pvc: PvcSource | None = None
    """A PersistentVolumeClaim holding the checkpoint (in cluster B too, under the same name, when
    remoteCluster is set)."""
    host_path: HostPathSource | None = None
    """A directory on every node of the pools (pre-staged weights)."""
    image: ImageSource | None = None
    """Weights baked into the worker image."""
    hugging_face: HuggingFaceSource | None = None
    """A Hugging Face Hub repo, pulled by an init container (`pdd models pull`) into the model
    volume before a pod's worker starts; resumable, its progress in the init container's log. A
    refused token or a missing repo sets condition ModelAvailable=False naming the cause."""


KVDtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8"]


class ModelShape(_Spec):
    """The few config.json fields that size the KV cache (the operator can't read weights)."""

    num_layers: int = Field(gt=0)
    """num_hidden_layers."""
    num_kv_heads: int = Field(gt=0, alias="numKVHeads")
    """num_key_value_heads (num_attention_heads when the model has no GQA)."""
    head_dim: int = Field(gt=0)
    """head_dim (hidden_size / num_attention_heads when absent)."""
    dtype: KVDtype = "bfloat16"
    """KV cache element type."""
    max_position_embeddings: int | None = Field(default=None, gt=0)
    """max_position_embeddings, the model's context. With it, a maxPromptTokens at or beyond it is
    refused (InvalidSpec)."""


class ModelSpec(_Spec):
    source: ModelSource
    """Where the checkpoint lives: exactly one of pvc, hostPath, image or huggingFace."""
    served_name: str = Field(min_length=1)
    """Model name clients send in OpenAI requests (the `model` field)."""
    mount_path: str = "/models"
    """Where a pvc, hostPath or huggingFace source is mounted in the worker containers."""
    kv_bytes_per_token: int | None = Field(default=None, gt=0)
    """KV cache bytes per token. Wins over model.config; set it for a KV dtype that differs from the
    checkpoint's (e.g. fp8). When neither is given the WAN link cannot be sized (condition
    LinkSized=Unknown, reason KVSizeUnknown)."""
    config: ModelShape | None = None
    """The config.json fields that size the KV cache (the operator cannot read the checkpoint); `pdd
    models inspect` prints this block. Optional."""


class Images(_Spec):
    worker: str = Field(min_length=1)
    """Worker image (torch inference core; runs P, RLD and MD)."""
    router: str = Field(min_length=1)
    """Router image (no torch)."""
    vllm_worker: str | None = Field(default=None, min_length=1)
    """vLLM worker image (docker buildx bake worker-vllm: vLLM's CUDA build and PDD), run by the
    roles whose engineType is vllm; required where one is."""
    redis: str = "redis:7.4-alpine"
    """Redis image for router.managedRedis."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """imagePullPolicy of every container."""
    pull_secrets: list[str] = Field(default_factory=list)
    """Names of image pull Secrets (in cluster B too, for MD)."""


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


Quantity = Annotated[
    int | str,
    AfterValidator(_quantity),
    Field(json_schema_extra={"pattern": QUANTITY_PATTERN}),
]


class Resources(_Spec):
    """A container's requests and limits (``{cpu: "4", memory: 16Gi, nvidia.com/gpu: 1}``).

    A role's resources lie over its pool's key by key (the pool names the GPUs, the role
    its CPU and memory); ``validation.py`` checks the result as the API server would."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Minimum resources per pod by name (cpu, memory, ...), e.g. {cpu: "8", memory: 64Gi}."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources per pod; GPUs, where a pod has any, are set here (nvidia.com/gpu: 1)."""

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
    """Node label that names the GPU model."""
    value: str = Field(min_length=1)
    """GPU model label value, e.g. NVIDIA-H100-80GB-HBM3."""
    memory_gib: float | None = Field(default=None, gt=0, alias="memoryGiB")
    """Memory of one GPU of this model, in GiB. With it, a kvCacheGiB that cannot fit is refused
    (InvalidSpec) instead of failing in the pod."""


class Toleration(_Spec):
    """One toleration (a pod's, as Kubernetes has it)."""

    key: str | None = None
    """Taint key to tolerate; empty with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] | None = None
    """Exists or Equal (default Equal)."""
    value: str | None = None
    """Taint value to match when operator is Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: int | None = None
    """For NoExecute: how long the pod stays bound after the taint appears."""

    def manifest(self) -> dict[str, Any]:
        """The toleration in a pod's spec: the fields that are set."""
        return self.model_dump(by_alias=True, exclude_none=True)


class Pool(_Spec):
    """A node pool: where a role's pods may run and what each pod asks for."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels a pod of this pool requires (e.g. a node pool name)."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations for the pool's taints (same shape as a pod's tolerations)."""
    resources: Resources = Field(default_factory=Resources)
    """Resources of each pod in this pool (requests and limits)."""
    gpu_type: GpuType | None = None
    """The GPU model of this pool, added to the node selector as labelKey=value. PDD puts prefill
    and decode on different chips; this is how a pool says which."""

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
    """Share of the GPU's memory vLLM may use, weights and KV cache together."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Requests one pod runs at once (its capacity as the router sees it)."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Context window (prompt plus output tokens)."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Per-step token budget (chunked prefill)."""
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    """GPUs the model spans in each pod (at most the pod's GPU limit)."""
    kv_cache_dtype: VllmKVCacheDtype | None = None
    """KV cache dtype (auto: the model's)."""
    enforce_eager: bool | None = None
    """No CUDA graphs or compiled model, a faster start and slower steps."""


#: vLLM's settings belong to a role on vLLM.
VLLM_NEEDS_ENGINE = Rule(
    "!has(self.vllm) || (has(self.engineType) && self.engineType == 'vllm')",
    f"{PATH}: vllm settings are set but engineType is pdd; set {PATH}.engineType: vllm or "
    f"drop {PATH}.vllm",
)


class WorkerRole(_Spec):
    """What every worker role has: its engine, its engine's settings and its resources."""

    model_config = ConfigDict(json_schema_extra=validations(VLLM_NEEDS_ENGINE))

    engine_type: EngineType = "pdd"
    """The role's inference engine: pdd (PDD's own, the worker image) or vllm (vLLM's, the
    images.vllmWorker image, pdd worker --engine vllm; its settings in vllm)."""
    engine: EngineSettings = Field(default_factory=EngineSettings)
    """Engine settings of worker pods. spec.engine applies to every worker role; prefill.engine,
    relay.engine and mainDecode.engine override it field by field (setting either KV cache field
    in a role replaces both shared ones). Unset fields take the worker's defaults."""
    vllm: VllmSettings | None = None
    """vLLM's own settings of a role whose engineType is vllm, by vLLM's names, rendered into its
    pdd worker flags (--gpu-memory-utilization, ...); each wins over the same setting in engine.
    Unset fields take vLLM's defaults."""
    resources: Resources = _default(WORKER_RESOURCES)
    """CPU and memory of each pod of this role, over its pool's resources key by key (the pool names
    the GPUs). Setting it replaces the whole default (no CPU limit, so that decode steps are not
    throttled)."""


class RoleReplicas(WorkerRole):
    replicas: int = Field(default=1, ge=0)
    """Number of pods of this role."""


class Relay(WorkerRole):
    model_config = ConfigDict(
        json_schema_extra=validations(
            VLLM_NEEDS_ENGINE,
            Rule(
                "self.maxReplicas >= self.minReplicas",
                "relay.maxReplicas is below relay.minReplicas",
                "'relay.maxReplicas (' + string(self.maxReplicas) + ') is below minReplicas ('"
                " + string(self.minReplicas) + '); raise maxReplicas or lower minReplicas'",
            ),
        )
    )
    min_replicas: int = Field(default=1, ge=1)
    """HPA lower bound."""
    max_replicas: int = Field(default=4, ge=1)
    """HPA upper bound; must be >= minReplicas."""
    target_load: float = Field(default=0.7, gt=0, le=1)
    """Target average pdd_worker_relay_load per relay pod (0..1 of a relay's capacity)."""


class SecretKeyRef(_Spec):
    name: str = Field(min_length=1)
    """Secret name."""
    key: str = "kubeconfig"
    """Key in the Secret's data holding the kubeconfig."""


class RemoteCluster(_Spec):
    kubeconfig_secret: SecretKeyRef
    """Secret in the PDDDeployment's namespace holding a kubeconfig for cluster B (static token or
    client certificate; exec plugins are not supported)."""
    namespace: str | None = None
    """Namespace in cluster B (must exist); defaults to the PDDDeployment's namespace."""
    service_domain: str = "clusterset.local"
    """DNS domain for Services across the clusters (multi-cluster services); peers address each
    other as <service>.<namespace>.svc.<serviceDomain>."""
    main_decode_host: str | None = None
    """Host cluster A uses to reach MD, when it is not <name>-main.<namespace>.svc.<serviceDomain>
    (e.g. a load balancer)."""
    pool: Pool = Field(default_factory=Pool)
    """Node pool in cluster B for main-decode (MD)."""


class WanTls(_Spec):
    """TLS on the data channels that cross the WAN (P -> MD KV, MD <-> RLD handoff)."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            Rule(
                "!has(self.secretName) || self.enabled",
                "wan.tls.secretName is set but wan.tls.enabled is false; set enabled: true to "
                "use the Secret, or drop secretName",
            )
        )
    )

    enabled: bool = False
    """Encrypt the WAN channels."""
    secret_name: str | None = Field(default=None, min_length=1)
    """A Secret, in this namespace and in cluster B's, holding tls.crt, tls.key and ca.crt
    (cert-manager's layout). Without it the operator generates a CA and a certificate once, into
    a Secret of its own."""


#: How KV crosses the WAN (kvCodec, mdRecomputeMaxTokens, transferTimeoutSeconds) is
#: ``WanKVSettings``: the fields the config document's ``wan`` section and the router's and the
#: workers' flags share. (No docstring: ``spec.wan``'s own description is the CRD's.)
class Wan(_Spec, WanKVSettings):
    declared_gbps: float = Field(gt=0)
    """Bandwidth of the link in Gbit/s, as provisioned."""
    rtt_ms: float = Field(default=30.0, ge=0)
    """Round-trip time of the link in milliseconds."""
    tls: WanTls = Field(default_factory=WanTls)
    """TLS 1.3 on the data channels that cross the WAN (P to MD KV, MD to RLD handoff); peers verify
    each other's certificate against the deployment's CA (mutual TLS when the certificate allows
    client use). Channels inside a datacenter stay plaintext."""


class Workload(_Spec):
    request_rate: float = Field(ge=0)
    """Requests per second."""
    mean_input_tokens: float = Field(ge=0)
    """Mean prompt length in tokens."""
    mean_output_tokens: float = Field(ge=0)
    """Mean completion length in tokens."""
    mean_md_hit_rate: float = Field(ge=0, le=1, alias="meanMDHitRate")
    """Mean prefix-cache hit rate on the MD side, 0..1 (multi-turn traffic: about 0.9)."""


#: The objectives the config document carries (ttftP99Ms, tpotMs) are ``SloSection``'s fields,
#: declared once there; the planner's targets, which only the operator reads, are its own.
class Slo(_Spec, SloSection):
    ttft_p90_seconds: float | None = Field(default=None, gt=0)
    """The planner's target for client-side time to first token (queue time included), 90th
    percentile, in seconds."""
    itl_p90_seconds: float | None = Field(default=None, gt=0)
    """The planner's target for the inter-token latency, 90th percentile, in seconds."""


class PlannerPool(_Spec):
    """What the planner may buy of one worker role: its price and its bounds."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            Rule(
                "self.maxReplicas >= self.minReplicas",
                f"{PATH}.maxReplicas is below minReplicas",
                f"'{PATH}.maxReplicas is below minReplicas (' + string(self.maxReplicas) + ' < '"
                " + string(self.minReplicas) + ')'",
            )
        )
    )

    cost_per_hour: float | None = Field(default=None, ge=0)
    """Dollars per replica-hour; unset, every role's replica costs the same."""
    min_replicas: int = Field(default=1, ge=1)
    """Fewest replicas the planner asks for."""
    max_replicas: int = Field(default=16, ge=1)
    """Most replicas the planner asks for."""


class Planner(_Spec):
    """The SLO planner: P, RLD and MD sized for ``slo``'s P90 targets at least cost, each
    through its own HPA on ``pdd_planner_desired_replicas{role}``. Off: the relay's HPA on
    relay load, and P and MD at their fixed ``replicas``."""

    enabled: bool = False
    """Scale every role through the planner's HPAs."""
    interval_seconds: int = Field(default=60, ge=10)
    """Seconds between two plans."""
    predictor: Literal["last", "trend"] = "trend"
    """How the next interval's load is predicted: last (the last interval's) or trend (a
    least-squares line through the last few)."""
    prefill: PlannerPool = Field(default_factory=PlannerPool)
    """What the planner may buy of prefill."""
    relay: PlannerPool = Field(default_factory=PlannerPool)
    """What the planner may buy of relay decode."""
    main_decode: PlannerPool = Field(default_factory=PlannerPool)
    """What the planner may buy of main decode."""


class ApiKeysSecret(_Spec):
    """A Secret of the router's namespace holding the client API keys the router accepts."""

    name: str = Field(min_length=1)
    """The Secret's name."""
    key: str = Field(default="api-keys", min_length=1)
    """The key in the Secret that holds the API keys."""


class Router(_Spec):
    model_config = ConfigDict(
        json_schema_extra=validations(
            Rule(
                "!(has(self.redisUrl) && self.managedRedis)",
                "router.redisUrl and router.managedRedis are both set; use one: an external "
                "Redis URL, or managedRedis: true for a Redis the operator runs",
            ),
            Rule(
                "self.replicas <= 1 || has(self.redisUrl) || self.managedRedis",
                "router.replicas > 1 needs shared state: set router.redisUrl or "
                "router.managedRedis: true, or use one router replica",
            ),
        )
    )

    replicas: int = Field(default=1, ge=1)
    """Router pods; more than one needs redisUrl or managedRedis for shared state."""
    api_keys_secret: ApiKeysSecret | None = None
    """A Secret in this namespace with the client API keys the router accepts (commas, spaces or
    newlines between keys); clients send the header "Authorization: Bearer <key>". Without it the
    router accepts any client."""
    redis_url: str | None = None
    """External Redis for shared router state, e.g. redis://redis:6379/0."""
    managed_redis: bool = False
    """Run a single in-memory Redis for the routers (soft state only)."""
    resources: Resources = _default(ROUTER_RESOURCES)
    """CPU and memory of each router pod (tokenizing prompts is its main work). Setting it replaces
    the whole default."""


class Handoff(_Spec):
    policy: Literal["auto", "oneShot", "catchUp"] = "auto"
    """oneShot: all tokens at once (RLD freed soonest); catchUp: chunks while RLD keeps relaying
    (smaller MD stalls); auto: switch by RLD load."""
    catch_up_threshold: int = Field(default=64, ge=1)
    """Tokens above which a handoff goes in catch-up chunks."""


class AnomalousTraffic(_Spec):
    min_input_tokens: int = Field(default=32768, ge=1)
    """Input length from which a request can be anomalous."""
    max_output_tokens: int = Field(default=500, ge=1)
    """max_tokens up to which a long-input request is anomalous."""


#: An OTLP endpoint as the CRD's CEL rule reads one: http(s), a host, then anything.
TRACING_ENDPOINT_PATTERN = r"https?://[^/?#\s]+([/?#].*)?"
_CEL_TRACING_ENDPOINT = TRACING_ENDPOINT_PATTERN.replace("\\", "\\\\")  # in a CEL '...'


class Tracing(_Spec):
    """OpenTelemetry spans from every pod (docs/tracing.md): where they go, how many."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            Rule(
                f"self.endpoint.matches('^{_CEL_TRACING_ENDPOINT}$')",
                "observability.tracing.endpoint must be an http:// or https:// URL with a host",
                "'observability.tracing.endpoint must be an http:// or https:// URL with a host, "
                "not \\'' + self.endpoint + '\\''",
            )
        )
    )

    endpoint: str = Field(min_length=1)
    """The OTLP traces endpoint (a Collector, Jaeger, Tempo), http:// or https://; OTLP/HTTP's
    /v1/traces is added to a URL without a path."""
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    """The share of requests traced (parentbased_traceidratio; a client's sampled traceparent is
    honoured)."""


class Observability(_Spec):
    tracing: Tracing | None = None
    """OpenTelemetry spans from the router and every worker pod over OTLP: one trace per request,
    router to MD. Unset: no spans."""


class PDDSpec(_Spec):
    """Desired state of a PDD (prefill / relay-decode / main-decode) serving deployment."""

    model_config = ConfigDict(json_schema_extra=validations(*SPEC_RULES))

    model: ModelSpec
    """The model every worker serves."""
    images: Images
    """Container images."""
    pool_a: Pool = Field(default_factory=Pool)
    """Node pool in cluster A for prefill (P) and relay-decode (RLD): the prefill-strong GPUs."""
    prefill: RoleReplicas = Field(default_factory=RoleReplicas)
    """Prefill (P) instances on pool A."""
    relay: Relay = Field(default_factory=Relay)
    """Relay-decode (RLD) instances on pool A, scaled by an HPA on the pods' pdd_worker_relay_load
    metric."""
    pool_b: Pool | None = None
    """Node pool in this cluster for main-decode (MD): the decode-strong GPUs. Exactly one of poolB
    or remoteCluster."""
    remote_cluster: RemoteCluster | None = None
    """Run main-decode (MD) in another cluster (cluster B), reached through a kubeconfig stored in a
    Secret. Exactly one of poolB or remoteCluster. Cluster B objects carry the label
    pdd.dev/owner-uid and are deleted by the operator's finalizer."""
    main_decode: RoleReplicas = Field(default_factory=RoleReplicas)
    """Main-decode (MD) instances on pool B or in cluster B."""
    wan: Wan
    """The WAN link between cluster A (P, RLD) and the MD side."""
    workload: Workload | None = None
    """Expected traffic, used to size the WAN link and the relay pool (status.wan)."""
    slo: Slo = Field(default_factory=Slo)
    """Latency objectives."""
    planner: Planner = Field(default_factory=Planner)
    """The SLO planner (docs/planner.md): sizes prefill, relay and main decode for
    slo.ttftP90Seconds and slo.itlP90Seconds at least cost and publishes
    pdd_planner_desired_replicas{role}; one HPA per role follows it (External metric,
    AverageValue 1). Off: the relay HPA on relay load, and prefill and main decode at their
    replicas."""
    router: Router = Field(default_factory=Router)
    """The OpenAI-compatible router (Service <name>-router, ClusterIP, port 8080)."""
    handoff: Handoff = Field(default_factory=Handoff)
    """How RLD hands generated tokens to MD once MD holds the KV."""
    anomalous_traffic: AnomalousTraffic = Field(default_factory=AnomalousTraffic)
    """Requests with very long input and short output run to completion on RLD and never cross the
    WAN."""
    observability: Observability = Field(default_factory=Observability)
    """What every pod reports beyond its metrics (docs/tracing.md)."""
    engine: EngineSettings = Field(default_factory=EngineSettings)
    """Engine settings of worker pods. spec.engine applies to every worker role; prefill.engine,
    relay.engine and mainDecode.engine override it field by field (setting either KV cache field
    in a role replaces both shared ones). Unset fields take the worker's defaults."""
    drain_seconds: int = Field(default=30, ge=0)
    """How long a worker pod told to stop (a rollout, a scale-down, a node drain) may take to finish
    its requests: it leaves its Service at once, a relay hands every request to MD as soon as MD
    holds the KV, MD finishes its streams. The pod's terminationGracePeriodSeconds is this plus
    10."""
    startup_seconds: int = Field(default=900, ge=10)
    """How long a worker pod may take from start to serving (loading the model onto its GPU) before
    kubelet restarts it; its startup probe's budget. Liveness and readiness probes start once it
    passes."""

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
