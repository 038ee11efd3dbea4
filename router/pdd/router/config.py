"""The router's configuration: command-line flags, optionally on top of the operator's file.

The operator renders one JSON document per cluster (``/etc/pdd/config.json``, see
``pdd.operator.builders.config``) with each worker role's Service host; the router
reads it with ``--config`` and resolves those hosts to instances. Flags override the
file, so a developer can run the same binary against ``--prefill p=http://...`` lists.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pdd.common.config_document import ConfigDocument
from pdd.common.cost_model import LinkState, kv_bytes_per_token, kv_bytes_per_token_from_hf_config
from pdd.common.kv_codec import NO_CODEC, KVCodec
from pdd.common.vocabulary import Role, ToolCallFormat
from pdd.common.wan_tls import HTTPS_ROLES
from pdd.router.tokenization import TINY_MODEL

#: The ``tiny`` preset's KV shape (4 layers x 2 KV heads x 32 dims, float32 bytes).
TINY_KV_SHAPE = (4, 2, 32, 4)
#: KV bytes per token of the ``tiny`` preset; a test checks it against the worker's own
#: ``tiny_config``.
TINY_KV_BYTES_PER_TOKEN = kv_bytes_per_token(*TINY_KV_SHAPE)


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


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router process needs; derived values are properties."""

    workers: tuple[WorkerRef, ...]
    secret: str
    model: str = TINY_MODEL
    served_model_name: str | None = None
    redis_url: str | None = None
    #: The longest a request waits for Redis (prefix lookup, loads) before it is routed
    #: on this replica's local state and the store counts Redis as down.
    redis_deadline_s: float = 0.25
    api_keys: tuple[str, ...] = ()
    link_gbps: float = 10.0
    link_rtt_ms: float = 0.0
    ttft_budget_s: float = 2.0
    #: P's prefill throughput until the router has measured it (the estimator's prior).
    prefill_tokens_per_s: float = 10_000.0
    #: Decide on the declared link and prefill rate, learning nothing (a benchmark's
    #: baseline for the live view: ``pdd.common.link_estimator``).
    static_link_view: bool = False
    #: KV bytes per token on the WAN; None: from the checkpoint's shape and ``kv_codec``.
    kv_bytes_per_token: int | None = None
    #: How P codes the KV it sends MD across the WAN (spec.wan.kvCodec).
    kv_codec: KVCodec = NO_CODEC
    block_size: int = 16
    host: str = "0.0.0.0"
    port: int = 8080
    #: Requests one instance may hold at once before the router stops sending more:
    #: what the worker reports (its max_running); a number here caps every instance
    #: below that (an operator's override, e.g. to shed load before the workers queue).
    instance_capacity: int | None = None
    max_body_bytes: int = 4 << 20
    #: A cap below what the prefill instances take (they report their own limit); None:
    #: theirs alone. Longer prompts get a 400 before anything is dispatched.
    max_prompt_tokens: int | None = None
    default_max_tokens: int = 256
    #: The most output tokens one request may ask for (None: only the model's context
    #: bounds it); more is a 400 with the limit, before anything is dispatched.
    max_tokens_limit: int | None = None
    #: Requests one API key (or, without keys, all clients together) may have in flight;
    #: one more is a 429 with Retry-After. None: no limit.
    max_streams_per_key: int | None = None
    #: Requests the router admits at once, all keys together (``fair_admission``): past
    #: it a request waits up to ``admission_wait_s`` in its key's queue, served in turn
    #: with the other keys', then gets a 429. None: no router-wide cap.
    max_inflight_requests: int | None = None
    admission_wait_s: float = 0.5
    poll_interval_s: float = 0.5
    request_timeout_s: float = 300.0
    retry_after_s: float = 1.0
    handoff: Literal["auto", "one-shot", "catch-up"] = "auto"
    catchup_threshold: int = 64
    anomalous_min_input_tokens: int = 32_000
    anomalous_output_tokens_below: int = 500
    #: Baselines for benchmarks: "naive" sends every request P -> MD shipping the full
    #: KV with no decode-side cache (naive cross-datacenter PD); None lets the policy choose.
    force_pipeline: Literal["naive"] | None = None
    replica_id: str = field(default_factory=lambda: f"router-{os.getpid()}")
    #: The WAN TLS folder (only its ``ca.crt`` is read): https workers' certificates must
    #: chain to it. None: https workers are checked against the system's CAs.
    wan_tls_dir: Path | None = None
    #: How the model writes tool calls (what the tool-call parser reads); None: detected
    #: from the chat template (``pdd.router.tool_calls.detect_format``).
    tool_call_format: ToolCallFormat | None = None

    def __post_init__(self) -> None:
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
        the tiny preset) coded with ``kv_codec``."""
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        if self.model == TINY_MODEL:
            return kv_bytes_per_token(*TINY_KV_SHAPE, codec=self.kv_codec)
        config_file = Path(self.model) / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{config_file} not found: pass --kv-bytes-per-token")
        config = json.loads(config_file.read_text())
        return kv_bytes_per_token_from_hf_config(config, codec=self.kv_codec)


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
    settings: dict[str, Any] = {
        "model": doc.model.path,
        "served_model_name": doc.model.served_name,
        "kv_bytes_per_token": doc.model.kv_bytes_per_token,
        "kv_codec": doc.wan.kv_codec,
        "link_gbps": doc.wan.declared_gbps,
        "link_rtt_ms": doc.wan.rtt_ms,
        "redis_url": doc.store.redis_url,
        "port": doc.ports.router,
        "handoff": doc.handoff.flag,
        "catchup_threshold": doc.handoff.catch_up_threshold,
        "anomalous_min_input_tokens": doc.anomalous_traffic.min_input_tokens,
        "anomalous_output_tokens_below": doc.anomalous_traffic.max_output_tokens,
        "ttft_budget_s": doc.slo.ttft_p99_ms / 1000.0,
        "workers": tuple(
            WorkerRef(
                role=Role(role),
                http_url=f"{_scheme(Role(role), wan_tls)}://{peer.host}:{peer.http_port}",
                dns_host=peer.host,
                http_port=peer.http_port,
            )
            for role, peer in doc.peers.workers().items()
        ),
        "secret_env": doc.shared_secret_env,
    }
    return settings


def _scheme(role: Role, wan_tls: bool) -> str:
    return "https" if wan_tls and role in HTTPS_ROLES else "http"
