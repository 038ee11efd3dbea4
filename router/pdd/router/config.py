"""The router's configuration: command-line flags, optionally on top of the operator's file.

The operator renders one JSON document per cluster (``/etc/pdd/config.json``, see
``pdd.operator.builders.config``) with each worker role's Service host; the router
reads it with ``--config`` and resolves those hosts to instances. Flags override the
file, so a developer can run the same binary against ``--prefill p=http://...`` lists.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.common.config_document import (
    HANDOFF_POLICIES,
    ConfigDocument,
    SloFlags,
    StoreSection,
    WanKVSettings,
)
from pdd.common.cost_model import LinkState, kv_bytes_per_token, kv_bytes_per_token_from_hf_config
from pdd.common.gguf_file import GGUFModelFile, gguf_checkpoint
from pdd.common.kv_codec import (
    ADAPTIVE,
    ADAPTIVE_CODECS,
    NO_CODEC,
    KVCodec,
    KVCodecSetting,
    default_codec,
)
from pdd.common.settings import (
    Setting,
    from_document,
    read_document,
    same_setting,
    setting,
    settings_of,
)
from pdd.common.vocabulary import Role, ToolCallFormat
from pdd.common.wan_line import WanLine
from pdd.common.wan_tls import HTTPS_ROLES
from pdd.router.policy_inputs import PolicyConfig
from pdd.router.tokenization import TINY_MODEL

#: The ``tiny`` preset's KV shape (4 layers x 2 KV heads x 32 dims, float32 bytes).
TINY_KV_SHAPE = (4, 2, 32, 4)
#: KV bytes per token of the ``tiny`` preset; a test checks it against the worker's own
#: ``tiny_config``.
TINY_KV_BYTES_PER_TOKEN = kv_bytes_per_token(*TINY_KV_SHAPE)


#: The WAN settings' defaults (``WanKVSettings``: the CRD's, the document's, the flags').
_WAN_KV = WanKVSettings()
#: Where the replicas share state (``StoreSection``: ``pdd up --redis`` sets it too).
_STORE = StoreSection.model_fields
#: The SLO's flag (``SloFlags``: ``pdd up --ttft-budget-s`` is the same setting).
_SLO = SloFlags.model_fields
#: The WAN line's settings (``WanLine``), of which the router declares the rate and RTT.
_LINE = WanLine.model_fields
#: The ``WanKVSettings`` fields the router reads (``transfer_timeout_seconds`` is the workers').
ROUTER_WAN_SETTINGS = frozenset({"kv_codec", "md_recompute_max_tokens"})


class ConfigError(ValueError):
    """A flag or config-file value is missing or inconsistent; the message says which."""


@dataclass(frozen=True)
class WorkerRef:
    """A worker the router was told about: a fixed instance or a Service host to resolve.

    ``instance_id`` is None for a DNS source: each address it resolves to is one
    instance, named by what the worker's ``/health`` reports.
    """

    role: Role
    http_url: str
    instance_id: str | None = None
    dns_host: str | None = None
    http_port: int | None = None

    @property
    def scheme(self) -> str:
        """How its control API is dialled: ``https`` where the URL says so."""
        return "https" if self.http_url.startswith("https://") else "http"


def parse_worker(role: Role, text: str) -> WorkerRef:
    """``ID=URL`` (the form the issue and the flags use) -> a fixed instance."""
    instance_id, sep, url = text.partition("=")
    if not sep or not instance_id or not url.startswith(("http://", "https://")):
        raise ConfigError(f"--{role} {text!r}: expected INSTANCE_ID=http://HOST:PORT")
    return WorkerRef(role=role, http_url=url.rstrip("/"), instance_id=instance_id)


class RouterConfig(BaseModel):
    """Everything the router process needs: the router's settings table; derived values are
    properties.

    A field made with ``setting`` is a flag and a row of docs/configuration.md (its help,
    default and config-document field written here once), one made with ``from_document``
    a value the document alone sets; ``file_settings`` reads the document's values straight
    into these fields by the path (and conversion) each declares, and ``build_config`` lays
    the flags given over them. The consistency of the whole (workers, secret, limits) is
    checked after validation and refused as a ``ConfigError`` saying what to pass."""

    # validate_by_name: a field that is a document section's (``same_setting``) keeps the
    # section's camelCase alias; the router's code passes its fields by name.
    model_config = ConfigDict(frozen=True, validate_by_name=True)

    workers: tuple[WorkerRef, ...]
    secret: str
    model: str = setting(
        TINY_MODEL,
        '"tiny" or a checkpoint directory (its tokenizer and chat template)',
        field="model.path",
    )
    served_model_name: str | None = setting(
        None,
        "the model name clients send",
        default_text="the --model folder's name",
        field="model.servedName",
    )
    redis_url: str | None = same_setting(_STORE["redis_url"], field="store.redisUrl")
    #: The longest a request waits for Redis (prefix lookup, loads) before it is routed
    #: on this replica's local state and the store counts Redis as down.
    redis_deadline_s: float = setting(
        0.25,
        "longest a request waits for Redis before it is routed on local state",
    )
    api_keys: tuple[str, ...] = ()
    #: The line the router declares (its estimator's prior, refined from measured transfers
    #: unless ``static_link_view``): ``WanLine``'s rate and round trip, the settings
    #: ``pdd wan-link`` runs and ``pdd up`` writes as spec.wan. Where none is declared,
    #: a 10 Gbit/s line (the line has no default rate of its own).
    link_gbps: float = same_setting(_LINE["gbps"], field="wan.declaredGbps", default=10.0)
    link_rtt_ms: float = same_setting(_LINE["rtt_ms"], field="wan.rttMs")
    #: The TTFT budget P-MD must meet: ``SloFlags``' setting (pdd up's flag too), read from
    #: the document's slo.ttftP99Ms. Its default differs: a deployment that sets no SLO runs
    #: on the CRD's 5 s, a router started alone on the policy's 2 s. The two were chosen
    #: apart (f8a6394 gave the router core 2 s, 21d3351 the CRD 5000 ms) and no commit or doc
    #: gives a reason for the difference; 2 s is kept so that routers started alone, the
    #: simulator (``PolicyConfig``'s default) and the tests keep the budget they decide on.
    ttft_budget_s: float = same_setting(
        _SLO["ttft_budget_s"], default=PolicyConfig.default_of("ttft_budget_s")
    )
    #: P's prefill throughput until the router has measured it (the estimator's prior).
    prefill_tokens_per_s: float = setting(
        10_000.0,
        "P's prefill throughput before any is measured (the prior)",
    )
    #: Decide on the declared link and prefill rate, learning nothing (a benchmark's
    #: baseline for the live view: ``pdd.common.link_estimator``).
    static_link_view: bool = setting(
        False,
        "decide on the declared link and prefill rate only, learning nothing (a baseline "
        "for benchmarks; the KV backlog is still counted)",
    )
    #: KV bytes per token on the WAN; None: from the checkpoint's shape and ``kv_codec``.
    kv_bytes_per_token: int | None = setting(
        None,
        "KV bytes per token on the WAN",
        default_text="from the checkpoint's shape and --kv-codec",
        field="model.kvBytesPerToken",
    )
    #: How P codes the KV it sends MD across the WAN, and the most prompt tokens MD may
    #: compute itself (PolicyConfig): ``WanKVSettings``' fields, whose flags, help and
    #: defaults they are (``ROUTER_WAN_SETTINGS``).
    kv_codec: KVCodecSetting = from_document(_WAN_KV.kv_codec, "wan.kvCodec")
    md_recompute_max_tokens: int = from_document(
        _WAN_KV.md_recompute_max_tokens, "wan.mdRecomputeMaxTokens"
    )
    block_size: int = setting(
        DEFAULT_BLOCK_SIZE,
        "tokens per KV block (the workers')",
    )
    host: str = setting(
        "0.0.0.0",
        "address to listen on",
    )
    port: int = setting(
        8080,
        "port of the OpenAI API",
        field="ports.router",
    )
    #: Requests one instance may hold at once before the router stops sending more:
    #: what the worker reports (its max_running_requests); a number here caps every instance
    #: below that (an operator's override, e.g. to shed load before the workers queue).
    instance_capacity: int | None = setting(
        None,
        "cap on requests per instance before 429",
        default_text="each worker's reported capacity",
    )
    max_body_bytes: int = setting(
        4 << 20,
        "largest request body accepted (413 above)",
    )
    #: A cap below what the prefill instances take (they report their own limit); None:
    #: theirs alone. Longer prompts get a 400 before anything is dispatched.
    max_prompt_tokens: int | None = setting(
        None,
        "longest prompt accepted (400 above)",
        default_text="what the prefill workers take",
    )
    default_max_tokens: int = setting(
        256,
        "max_tokens of a request that sets none (bounded by the context)",
    )
    #: The most output tokens one request may ask for (None: only the model's context
    #: bounds it); more is a 400 with the limit, before anything is dispatched.
    max_tokens_limit: int | None = setting(
        None,
        "most output tokens a request may ask for (400 above)",
        default_text="the context left after the prompt",
    )
    #: Requests one API key (or, without keys, all clients together) may have in flight;
    #: one more is a 429 with Retry-After. None: no limit.
    max_streams_per_key: int | None = setting(
        None,
        "requests one API key may have in flight (429 above; without keys: all clients)",
        default_text="no limit",
    )
    #: Requests the router admits at once, all keys together (``fair_admission``): past
    #: it a request waits up to ``admission_wait_s`` in its key's queue, served in turn
    #: with the other keys', then gets a 429. None: no router-wide cap.
    max_inflight_requests: int | None = setting(
        None,
        "requests in flight, all keys together, before new ones queue (fair per key)",
        default_text="no cap",
    )
    admission_wait_s: float = setting(
        0.5,
        "longest a request queues for a slot before its 429, seconds",
    )
    poll_interval_s: float = setting(
        0.5,
        "seconds between polls of each worker's load",
    )
    request_timeout_s: float = setting(
        300.0,
        "longest a request may run end to end, seconds",
    )
    retry_after_s: float = 1.0
    handoff: Literal["auto", "one-shot", "catch-up"] = setting(
        "auto",
        "how RLD hands requests to MD",
        field="handoff.policy",
        convert=HANDOFF_POLICIES.__getitem__,
    )
    catchup_threshold: int = setting(
        64,
        "catch-up handoff: tokens MD may lag before it takes over",
        field="handoff.catchUpThreshold",
    )
    anomalous_min_input_tokens: int = from_document(32_000, "anomalousTraffic.minInputTokens")
    anomalous_output_tokens_below: int = from_document(500, "anomalousTraffic.maxOutputTokens")
    #: Baselines for benchmarks: "naive" sends every request P -> MD shipping the full
    #: KV with no decode-side cache (naive cross-datacenter PD); None lets the policy choose.
    force_pipeline: Literal["naive"] | None = setting(
        None,
        "baseline for benchmarks: every request P -> MD with the full KV, no DRC",
        default_text="the policy chooses",
    )
    replica_id: str = setting(
        help="this replica's name in the shared store",
        default_text="router-<process id>",
        default_factory=lambda: f"router-{os.getpid()}",
    )
    #: The WAN TLS folder (only its ``ca.crt`` is read): https workers' certificates must
    #: chain to it. None: https workers are checked against the system's CAs.
    wan_tls_dir: Path | None = setting(
        None,
        "WAN TLS is on: a folder with the deployment's ca.crt; the workers reached across "
        "the WAN (main) are dialled with https and must chain to it",
        default_text="off",
    )
    #: How the model writes tool calls (what the tool-call parser reads); None: detected
    #: from the chat template (``pdd.router.tool_calls.detect_format``).
    tool_call_format: ToolCallFormat | None = setting(
        None,
        "how the model writes tool calls",
        default_text="detected from its chat template",
    )

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        self._check()

    def _check(self) -> None:
        if not self.secret:
            raise ConfigError("no shared secret: pass --secret, --secret-file or PDD_SHARED_SECRET")
        if not self.workers:
            raise ConfigError("no workers: pass --prefill/--relay/--main (or --mono) or --config")
        roles = {w.role for w in self.workers}
        if "mono" in roles and roles != {"mono"}:
            raise ConfigError("--mono workers cannot be mixed with prefill/relay/main workers")
        if "mono" not in roles and not {"prefill", "main"} <= roles:
            raise ConfigError(
                f"a PDD deployment needs at least one prefill and one main worker, got {roles}"
            )
        if self.instance_capacity is not None and self.instance_capacity <= 0:
            raise ConfigError(f"instance_capacity must be positive, got {self.instance_capacity}")
        for name in (
            "max_body_bytes", "max_prompt_tokens", "block_size", "max_tokens_limit",
            "max_streams_per_key", "max_inflight_requests",
        ):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def served_name(self) -> str:
        """The model name clients send; defaults to the checkpoint's directory name."""
        return self.served_model_name or Path(self.model).name

    @property
    def mono(self) -> bool:
        return all(w.role == "mono" for w in self.workers)

    @property
    def link(self) -> LinkState:
        return LinkState(declared_gbps=self.link_gbps, rtt_ms=self.link_rtt_ms)

    @property
    def resolved_kv_bytes_per_token(self) -> int:
        """KV bytes per token on the WAN: the flag, else the checkpoint's config.json (or
        the tiny preset) coded with ``kv_codec`` (adaptive: the exact codec's)."""
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        return self._coded_bytes_per_token(default_codec(self.kv_codec))

    @property
    def adaptive_codecs(self) -> tuple[tuple[KVCodec, int], ...]:
        """Under ``--kv-codec adaptive``: each codec the router may choose, least lossy
        first, with its KV bytes per token on the WAN (the exact codec's as resolved, the
        lossy ones' from the model's shape, which sets their scales); else ()."""
        if self.kv_codec != ADAPTIVE:
            return ()
        return tuple(
            (
                c,
                self.resolved_kv_bytes_per_token
                if c == NO_CODEC
                else self._coded_bytes_per_token(c),
            )
            for c in ADAPTIVE_CODECS
        )

    def _coded_bytes_per_token(self, codec: KVCodec) -> int:
        if self.model == TINY_MODEL:
            return kv_bytes_per_token(*TINY_KV_SHAPE, codec=codec)
        gguf_file = gguf_checkpoint(self.model)
        if gguf_file is not None:  # the shape is in the file's metadata
            gguf_config = GGUFModelFile(gguf_file).hf_config()
            return kv_bytes_per_token_from_hf_config(gguf_config, codec=codec)
        config_file = Path(self.model) / "config.json"
        if not config_file.is_file():
            raise ConfigError(
                f"{config_file} not found: pass --kv-bytes-per-token"
                + ("" if codec == NO_CODEC else f" (the {codec} codec's size needs the shape)")
            )
        config = json.loads(config_file.read_text())
        return kv_bytes_per_token_from_hf_config(config, codec=codec)


def router_settings() -> list[Setting]:
    """The router's settings table, its flags and docs/configuration.md's rows: RouterConfig's
    own, then the ``WanKVSettings`` fields it reads (named by their ``wan.`` field)."""
    wan = [
        dataclasses.replace(s, field=f"wan.{s.field}")
        for s in settings_of(WanKVSettings)
        if s.name in ROUTER_WAN_SETTINGS
    ]
    return settings_of(RouterConfig) + wan


def read_secret(secret: str | None, secret_file: Path | None, env_name: str) -> str:
    if secret:
        return secret
    if secret_file is not None:
        return secret_file.read_text().strip()
    return os.environ.get(env_name, "")


def file_settings(doc: ConfigDocument, wan_tls: bool = False) -> dict[str, Any]:
    """RouterConfig fields from the operator's config document.

    ``wan_tls``: WAN TLS is on (the router was given the CA), so the roles it reaches
    across the WAN (``HTTPS_ROLES``) are dialled with https."""
    return {
        # Each field that declares its document path (``setting(field=...)``, ``from_document``).
        **read_document(RouterConfig, doc.to_wire()),
        "workers": document_workers(doc, wan_tls),
        "secret_env": doc.shared_secret_env,
    }


def document_workers(doc: ConfigDocument, wan_tls: bool) -> tuple[WorkerRef, ...]:
    """Each worker role's Service in the document (its peers), as a host to resolve."""
    return tuple(
        WorkerRef(
            role=Role(role),
            http_url=f"{_scheme(Role(role), wan_tls)}://{peer.host}:{peer.http_port}",
            dns_host=peer.host,
            http_port=peer.http_port,
        )
        for role, peer in doc.peers.workers().items()
    )


def _scheme(role: Role, wan_tls: bool) -> str:
    return "https" if wan_tls and role in HTTPS_ROLES else "http"
