"""``pdd worker``'s options: one typed model, the source of its flags and what its code reads.

Each field that is a flag carries its help and default (``pdd.common.settings.setting``);
the engine's and the WAN's are the very fields of ``EngineSettings`` and ``WanKVSettings``
(``same_setting``: their help, defaults, vLLM aliases and bounds, declared once there for
the CRD, the config document and this flag alike). A field the config document sets names
its path in the document (``field=``); what the document gives per pod or per role (the
addresses, the identity, the role's engine settings) is built by
``pdd.worker.deploy_config.document_values``. ``pdd.worker.server.parse_args`` lays the
flags the command line gave over the document's values and validates the whole here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.common.config_document import (
    HANDOFF_POLICIES,
    SHARED_SECRET_ENV,
    EngineSettings,
    WanKVSettings,
)
from pdd.common.kv_codec import KVCodecSetting
from pdd.common.settings import from_document, same_setting, setting

#: A worker's role, as ``--role`` takes it.
WorkerRole = Literal["main", "mono", "prefill", "relay"]
#: The engines a worker drives.
EngineName = Literal["pdd", "vllm"]

_ENGINE = EngineSettings.model_fields
_WAN = WanKVSettings.model_fields

#: The engine settings' fields (``EngineSettings``), which are the worker's too.
ENGINE_FIELDS = frozenset(_ENGINE)
#: The ``WanKVSettings`` fields the worker reads (``md_recompute_max_tokens`` is the router's).
WORKER_WAN_SETTINGS = frozenset({"kv_codec", "transfer_timeout_seconds"})
#: The fields that size the KV cache (at most one applies; see ``server.build_engine``).
KV_SIZE_FIELDS = frozenset({"num_blocks", "kv_cache_memory_fraction", "kv_cache_gib"})


class VllmOnlySettings(BaseModel):
    """The settings vLLM has and the pdd engine does not, by vLLM's names (``pdd worker``
    and ``pdd generate`` both take them)."""

    model_config = ConfigDict(frozen=True)

    tensor_parallel_size: int = setting(1, "GPUs the model spans")
    kv_cache_dtype: str = setting("auto", "KV cache dtype (auto: the model's)")
    enforce_eager: bool = setting(
        False, "no compiled graphs: starts sooner (no warm-up with a set KV size)"
    )


_VLLM = VllmOnlySettings.model_fields


class WorkerOptions(VllmOnlySettings):
    """Everything one worker process is told: flags over the config document over defaults.

    ``role`` and ``instance_id`` have no default: a flag or (with ``--config``) the pod's
    environment gives them. Bounds are the settings' own (``kvCacheGiB`` > 0, ...), so a
    bad value is refused naming its flag before anything starts. vLLM's own settings are
    ``VllmOnlySettings``' fields, inherited (``pdd generate`` takes the same)."""

    model_config = ConfigDict(frozen=True, validate_by_name=True, extra="forbid")

    role: WorkerRole = setting(..., "required, or $PDD_ROLE with --config")
    model: str = setting(
        "tiny",
        '"tiny" (random weights, for tests), a checkpoint directory or a GGUF file',
        field="model.path",
    )
    instance_id: str = setting(..., "required, or $PDD_INSTANCE_ID with --config")
    http: str = setting("127.0.0.1:8000", "HOST:PORT of the control API")
    advertise_http: str | None = setting(None, "HOST:PORT the router uses", default_text="--http")
    data: str = setting("127.0.0.1:9000", "HOST:PORT to listen for KV")
    wan: str | None = setting(
        None,
        "HOST:PORT to listen for peers across the WAN",
        default_text="--data serves them",
    )
    advertise_fast: str | None = setting(None, "data address peers in this datacenter use")
    advertise_wan: str | None = setting(None, "data address peers across the WAN use")
    wan_tls_dir: Path | None = setting(
        None,
        "TLS on the WAN port and WAN dials, and on the HTTP port of the role the router "
        "reaches across the WAN (main): a folder with tls.crt, tls.key and ca.crt (needs "
        "--wan; peers must chain to ca.crt)",
    )
    secret_file: Path | None = setting(None, "shared secret (else $PDD_SHARED_SECRET)")
    #: The variable holding the shared secret (a hidden flag; the document names it).
    secret_env: str = from_document(SHARED_SECRET_ENV, "sharedSecretEnv")

    # The engine's settings table (``EngineSettings``); ``device`` also takes cuda:N.
    device: str | None = same_setting(_ENGINE["device"])
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = same_setting(_ENGINE["dtype"])
    max_running_requests: int | None = same_setting(_ENGINE["max_running_requests"])
    max_model_len: int | None = same_setting(_ENGINE["max_model_len"])
    max_prompt_tokens: int | None = same_setting(_ENGINE["max_prompt_tokens"])
    max_num_batched_tokens: int | None = same_setting(_ENGINE["max_num_batched_tokens"])
    torch_threads: int | None = same_setting(_ENGINE["torch_threads"])
    kv_cache_memory_fraction: float | None = same_setting(_ENGINE["kv_cache_memory_fraction"])
    kv_cache_gib: float | None = same_setting(_ENGINE["kv_cache_gib"])
    num_blocks: int | None = setting(None, "KV cache size in blocks (tests, benchmarks)")
    block_size: int | None = setting(
        None,
        "tokens per KV block, the router's too",
        default_text="16; with --engine vllm, vLLM's",
    )

    handoff: Literal["auto", "one-shot", "catch-up"] = setting(
        "auto",
        "how RLD hands a request to MD: one-shot, catch-up, or auto (by relay load)",
        field="handoff.policy",
        convert=HANDOFF_POLICIES.__getitem__,
    )
    catchup_load_level: float = setting(0.5, "auto handoff: relay load above this -> one-shot")

    # How KV crosses the WAN (``WanKVSettings``: spec.wan, the document's wan section).
    kv_codec: KVCodecSetting = same_setting(_WAN["kv_codec"], field="wan.kvCodec")
    transfer_timeout_seconds: float = same_setting(
        _WAN["transfer_timeout_seconds"], field="wan.transferTimeoutSeconds"
    )

    drain_seconds: float = setting(
        30.0,
        "on SIGTERM, how long to let running requests finish before exiting",
        field="drainSeconds",
    )
    drain_notice_seconds: float = setting(
        5.0,
        "on SIGTERM, keep serving what is still sent this long (routers poll every "
        "0.5 s; Kubernetes takes a few seconds to drop the pod from its Service)",
    )

    engine: EngineName = setting(
        "pdd", "the inference engine: PDD's own, or vLLM's AsyncLLM (the pdd[vllm] extra)"
    )
    router_block_size: int = setting(
        DEFAULT_BLOCK_SIZE,
        "the router's --block-size: vLLM's cached blocks are published as the router's "
        "blocks of this many tokens",
    )

    # Every pdd process's logging and tracing flags (``pdd.common.logs``, ``.tracing``).
    log_level: str = "INFO"
    log_format: str = "text"
    otlp_traces_endpoint: str | None = None
    traces_file: Path | None = None


#: The fields ``--help`` lists first: who this worker is and where it listens.
IDENTITY_FIELDS = (
    "role", "model", "instance_id", "http", "advertise_http", "data", "wan",
    "advertise_fast", "advertise_wan", "wan_tls_dir", "secret_file",
)  # fmt: skip
#: The vLLM-only fields, under ``--engine vllm``'s group.
VLLM_FIELDS = frozenset({*_VLLM, "router_block_size"})
