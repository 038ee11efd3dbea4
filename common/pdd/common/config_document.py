"""The config document: what the operator renders into every pod's ``/etc/pdd/config.json``.

One schema, three users: the operator builds a ``ConfigDocument`` and renders it
(``to_json``), the worker and the router parse it (``parse_config_document``) and
read it into their settings models, each field naming its path here
(``pdd.common.settings.read_document``); flags given on the command line win. Spellings on
the wire are camelCase, like the CRD the values come from. ``version`` is checked
before anything else, so an image older or newer than the operator says which to
upgrade instead of misreading fields; any other problem names the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from pdd.common.kv_codec import MD_RECOMPUTE_MAX_TOKENS, NO_CODEC, KVCodecSetting
from pdd.common.settings import setting

#: A worker's default wait for one hop of a request (``WanKVSettings.transfer_timeout_seconds``).
KV_TRANSFER_TIMEOUT_SECONDS = 30.0
#: Bumped when the document changes shape, so readers refuse what they do not understand.
CONFIG_VERSION: Literal[2] = 2
#: The environment variable that carries the shared secret into every pod.
SHARED_SECRET_ENV = "PDD_SHARED_SECRET"
#: The environment variable that carries the router's accepted client API keys (from a
#: Secret: commas, spaces or newlines between keys); never written into the config document.
API_KEYS_ENV = "PDD_API_KEYS"

HandoffPolicy = Literal["auto", "oneShot", "catchUp"]
#: The CRD's handoff policy names -> the worker's and router's ``--handoff`` values.
HANDOFF_POLICIES: dict[str, str] = {"auto": "auto", "oneShot": "one-shot", "catchUp": "catch-up"}


class ConfigDocumentError(ValueError):
    """The document is missing, unreadable, of another version, or has a bad field."""


class _Section(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, frozen=True, extra="forbid"
    )


class DeploymentRef(_Section):
    name: str = Field(min_length=1)
    namespace: str = Field(min_length=1)


class ModelSection(_Section):
    served_name: str = Field(min_length=1)
    #: Where the checkpoint is inside the container.
    path: str = Field(min_length=1)
    #: KV bytes per token on the WAN (as ``wan.kvCodec`` codes it), for the router's
    #: transfer estimate; None: the router reads the shape from the checkpoint's config.json.
    kv_bytes_per_token: int | None = Field(default=None, gt=0)


class Ports(_Section):
    http: int = Field(ge=1, le=65535)
    kv: int = Field(ge=1, le=65535, description="data port for peers in the same datacenter")
    #: Data port for peers across the WAN; None: the kv port serves them too.
    wan: int | None = Field(default=None, ge=1, le=65535)
    router: int = Field(ge=1, le=65535)


class WorkerPeer(_Section):
    """A worker role's Service, as seen from this document's cluster."""

    host: str = Field(min_length=1)
    http_port: int = Field(ge=1, le=65535)
    kv_port: int = Field(ge=1, le=65535)


class RouterPeer(_Section):
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)


class Peers(_Section):
    prefill: WorkerPeer
    relay: WorkerPeer
    main: WorkerPeer
    router: RouterPeer

    def workers(self) -> dict[str, WorkerPeer]:
        """Each worker role's Service, by role name."""
        return {"prefill": self.prefill, "relay": self.relay, "main": self.main}


class WanKVSettings(_Section):
    """How KV crosses the WAN: the settings of ``spec.wan`` that the router and the workers
    read, each declared once here.

    The CRD's ``spec.wan`` (``pdd.operator.spec.Wan``) and the config document's ``wan``
    section are subclasses, so a field added here is in both, and the operator copies every
    one of them (``wan_section``); ``pdd router`` and ``pdd worker`` generate their flags
    from the fields they read (``pdd.common.settings``: the description is the help,
    ``flagAliases`` the older spellings) and take the document's value straight from
    ``ConfigDocument.wan``. A field's default is the worker's and the router's default."""

    kv_codec: KVCodecSetting = Field(
        default=NO_CODEC,
        description="How prefill compresses the KV it sends main decode across the WAN; main "
        "decode restores it in its own dtype. none ships it exact; fp8 (e4m3), int8 and int4 "
        "quantize it with a scale and a centre per token and head, to about 0.52x, 0.52x and "
        "0.27x of bfloat16 KV at head dim 128, and are lossy, so greedy outputs may differ "
        "slightly from a colocated instance (docs/kv-codec.md). The relay's in-datacenter copy "
        "is always exact. Link sizing counts the compressed bytes. adaptive lets the router "
        "choose per request the least lossy of none, int8 and int4 whose transfer fits the TTFT "
        "budget on the live link estimate (the link is sized for none), before them having main "
        "decode compute a miss of at most mdRecomputeMaxTokens itself.",
    )
    md_recompute_max_tokens: int = Field(
        default=MD_RECOMPUTE_MAX_TOKENS,
        ge=0,
        description="The most prompt tokens main decode may compute itself, from their token "
        "IDs, on P-MD where that is sooner than the exact KV's crossing (prefill then computes "
        "nothing), and with kvCodec adaptive where the exact KV's transfer would miss the TTFT "
        "budget and that is sooner than any codec's (nothing but the request crosses, and "
        "nothing is lost). It bounds the prefill a decode instance takes on beside its batch. "
        "0 never does.",
    )
    transfer_timeout_seconds: float = Field(
        default=KV_TRANSFER_TIMEOUT_SECONDS,
        gt=0,
        description="The longest a worker waits on a hop of a request (prefill's KV reaching "
        "main decode across the WAN, a handoff from the relay) before the request fails over "
        "to the relay or fails. Raise it where one long prompt's KV takes longer than this on "
        "the line (at 1 Gbit/s, 30 s carries 3.75 GB).",
        json_schema_extra={"flagAliases": ["--transfer-timeout-s"]},
    )


class WanSection(WanKVSettings):
    declared_gbps: float = Field(gt=0)
    rtt_ms: float = Field(ge=0)


class SloSection(_Section):
    """The latency objectives: the settings of ``spec.slo`` the config document carries, each
    declared once here. The CRD's ``spec.slo`` (``pdd.operator.spec.Slo``) is a subclass, so
    its field, description and default are these, and the operator copies every field into
    the document (``slo_section``). A field's default is what a PDDDeployment that leaves
    ``slo`` out gets."""

    ttft_p99_ms: float = Field(
        default=5000.0,
        gt=0,
        description="Time to first token, 99th percentile, in milliseconds; also the TTFT budget "
        "the router uses to choose P-MD vs P-RLD-MD.",
    )
    tpot_ms: float = Field(default=50.0, gt=0, description="Time per output token in milliseconds.")


def ms_to_s(milliseconds: float) -> float:
    """The document's milliseconds (``slo.ttftP99Ms``) as a flag's seconds."""
    return milliseconds / 1000.0


class SloFlags(BaseModel):
    """The SLO as flags take it: ``--ttft-budget-s`` is ``slo.ttftP99Ms`` in seconds.

    ``pdd router`` and ``pdd up`` generate the flag from this one declaration (its help, and
    the document field it is read from through ``ms_to_s``); the default is the CRD's, what a
    deployment that sets no budget runs on. (``pdd router`` alone keeps a default of its own:
    see ``RouterConfig.ttft_budget_s``.)"""

    ttft_budget_s: float = setting(
        ms_to_s(SloSection.model_fields["ttft_p99_ms"].default),
        "TTFT budget the P -> MD path must meet, seconds",
        field="slo.ttftP99Ms",
        convert=ms_to_s,
    )


class HandoffSection(_Section):
    policy: HandoffPolicy
    catch_up_threshold: int = Field(ge=1)

    @property
    def flag(self) -> str:
        """The policy as a ``--handoff`` value."""
        return HANDOFF_POLICIES[self.policy]


class AnomalousTraffic(_Section):
    min_input_tokens: int = Field(ge=1)
    max_output_tokens: int = Field(ge=1)


class RelaySection(_Section):
    target_load: float = Field(gt=0, le=1)
    #: The custom metric each relay pod exports and the HPA scales on.
    load_metric: str = Field(min_length=1)


class EngineSettings(_Section):
    """A worker's engine settings: the engine's settings table.

    The same shape is ``spec.engine`` (shared by every worker role) and each role's
    ``engine`` override in the PDDDeployment, the resolved settings per role in the
    config document, and the ``pdd worker`` flags (``pdd.common.settings``: a field's
    description is its help, ``flagDefault`` the worker's default, ``flagAliases`` vLLM's
    names for the same setting). A field left unset takes the worker's default. The KV
    cache is sized by at most one of the two KV fields: ``_one_kv_size`` checks it wherever
    the model is read, and the CRD carries it as the CEL rule below (the API server's copy;
    the worker has no CEL evaluator, so the rule is written in both forms, here only)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.kvCacheMemoryFraction) && has(self.kvCacheGiB))",
                    "message": "kvCacheMemoryFraction and kvCacheGiB are both set; use one",
                }
            ]
        }
    )

    device: Literal["auto", "cpu", "cuda"] | None = Field(
        default=None,
        description="where the model runs: auto is CUDA when one is visible (the worker "
        "flag also takes cuda:N, one GPU of several)",
        json_schema_extra={"flagDefault": "auto", "flagMetavar": "{auto,cpu,cuda,cuda:N}"},
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = Field(
        default=None,
        description="weights', activations' and KV's type: auto is bfloat16 on CUDA; on a "
        "CPU the checkpoint's own where bfloat16 is native (AVX-512 BF16, AMX, Arm BF16), else "
        "float32 (bfloat16 asked for there runs, with a warning)",
        json_schema_extra={"flagDefault": "auto"},
    )
    kv_cache_memory_fraction: float | None = Field(
        default=None, gt=0, le=1,
        description="KV cache as this share of the device memory free after the weights load",
        json_schema_extra={
            "flagAliases": ["--gpu-memory-utilization"],
            "defaultText": "0.9 on CUDA; on the CPU 256 MiB",
        },
    )  # fmt: skip
    kv_cache_gib: float | None = Field(
        default=None, gt=0, alias="kvCacheGiB",
        description="KV cache size in GiB (instead of the memory fraction)",
    )  # fmt: skip
    max_running_requests: int | None = Field(
        default=None, ge=1,
        description="requests one instance runs at once (its capacity as the router sees it)",
        json_schema_extra={"flagDefault": 64, "flagAliases": ["--max-num-seqs"]},
    )  # fmt: skip
    max_model_len: int | None = Field(
        default=None, ge=1,
        description="context window: prompt plus output tokens",
        json_schema_extra={"defaultText": "the model's max_position_embeddings"},
    )  # fmt: skip
    max_prompt_tokens: int | None = Field(
        default=None, ge=1,
        description="longest prompt an instance takes",
        json_schema_extra={"defaultText": "the context window less one token"},
    )  # fmt: skip
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1,
        description="per-step token budget; longer prefills are computed in chunks of this size",
        json_schema_extra={"flagDefault": 512},
    )  # fmt: skip
    torch_threads: int | None = Field(
        default=None, ge=0,
        description="CPU threads torch uses (0: torch's default)",
        json_schema_extra={"flagDefault": 0},
    )  # fmt: skip

    @model_validator(mode="after")
    def _one_kv_size(self) -> EngineSettings:
        if self.kv_cache_memory_fraction is not None and self.kv_cache_gib is not None:
            raise ValueError("kvCacheMemoryFraction and kvCacheGiB are both set; use one")
        return self

    def over(self, shared: EngineSettings) -> EngineSettings:
        """These settings (a role's override) on top of ``shared``: a field set here wins,
        and setting either KV field here replaces both of the shared ones."""
        mine = self.model_dump(exclude_none=True)
        if {"kv_cache_memory_fraction", "kv_cache_gib"} & set(mine):
            shared = shared.model_copy(
                update={"kv_cache_memory_fraction": None, "kv_cache_gib": None}
            )
        return shared.model_copy(update=mine)


class EngineByRole(_Section):
    """Each worker role's engine settings, resolved (P, RLD and MD differ: P is
    compute-bound, MD holds the big decode-side cache)."""

    prefill: EngineSettings = Field(default_factory=EngineSettings)
    relay: EngineSettings = Field(default_factory=EngineSettings)
    main: EngineSettings = Field(default_factory=EngineSettings)

    def for_role(self, role: str) -> EngineSettings:
        """A role's settings; roles a deployment does not render (mono) get none."""
        return {"prefill": self.prefill, "relay": self.relay, "main": self.main}.get(
            role, EngineSettings()
        )


class StoreSection(_Section):
    """Where the router replicas keep their shared state: a setting of the router that
    ``pdd up`` sets too (through the PDDDeployment's spec.router.redisUrl), so its flag is
    declared here, below both (``pdd router --redis``, ``pdd up --redis``)."""

    redis_url: str | None = Field(
        default=None,
        description="redis://HOST:PORT/DB shared by router replicas; a comma-separated list "
        "fails over in order",
        json_schema_extra={"flagName": "redis", "defaultText": "none, local state"},
    )


class ConfigDocument(_Section):
    version: Literal[2] = CONFIG_VERSION
    deployment: DeploymentRef
    model: ModelSection
    ports: Ports
    peers: Peers
    wan: WanSection
    slo: SloSection
    handoff: HandoffSection
    anomalous_traffic: AnomalousTraffic
    engine: EngineByRole
    relay: RelaySection
    store: StoreSection
    shared_secret_env: str = Field(default=SHARED_SECRET_ENV, min_length=1)
    #: On SIGTERM a worker finishes its requests for up to this long, then exits.
    drain_seconds: float = Field(ge=0)

    def to_wire(self) -> dict[str, Any]:
        """The document as plain JSON values, camelCase keys (what is hashed and written)."""
        return self.model_dump(mode="json", by_alias=True)

    def to_json(self) -> str:
        return json.dumps(self.to_wire(), sort_keys=True, indent=2) + "\n"


def parse_config_document(data: object, component: str) -> ConfigDocument:
    """Validate a decoded document for ``component`` ("worker", "router").

    A document of another version is refused with what to upgrade; any other problem
    names every bad field by its path in the document, e.g. ``model.kvBytesPerToken``.
    """
    if not isinstance(data, dict):
        raise ConfigDocumentError("the config document must be a JSON object")
    version = data.get("version")
    if version != CONFIG_VERSION:
        raise ConfigDocumentError(
            f"config version {version!r} is not {CONFIG_VERSION}; "
            f"upgrade the {component} image to match the operator"
        )
    try:
        return ConfigDocument.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigDocumentError(f"invalid config document: {problems}") from None


def read_config_document(path: Path, component: str) -> ConfigDocument:
    """Read and validate the file at ``path``; every failure is a ``ConfigDocumentError``."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigDocumentError(f"config file {path} not found") from None
    except OSError as exc:
        raise ConfigDocumentError(f"config file {path} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigDocumentError(f"config file {path} is not valid JSON: {exc}") from None
    try:
        return parse_config_document(data, component)
    except ConfigDocumentError as exc:
        raise ConfigDocumentError(f"config file {path}: {exc}") from None
