"""``pdd router``: the OpenAI-compatible front door of a PDD deployment.

Flags, optionally on top of the operator's rendered config (``--config``); then one
uvicorn server around the app. Exit status 2 for a configuration error, with the
message saying what to fix.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import uvicorn

from pdd.common.config_document import (
    API_KEYS_ENV,
    SHARED_SECRET_ENV,
    ConfigDocumentError,
    read_config_document,
)
from pdd.common.kv_codec import KV_CODECS
from pdd.common.vocabulary import Role, ToolCallFormat
from pdd.router.app import create_app
from pdd.router.config import (
    ConfigError,
    RouterConfig,
    file_settings,
    parse_worker,
    read_secret,
)
from pdd.router.runtime import RouterRuntime

log = logging.getLogger("pdd.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdd router", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="the operator's config.json (flags override it)")
    p.add_argument("--model", help='"tiny" or a checkpoint directory (tokenizer and template)')
    p.add_argument("--served-model-name", help="the model name clients send")
    for role in Role:
        p.add_argument(
            f"--{role}", action="append", default=[], metavar="ID=URL",
            help=f"a {role} worker (repeatable, or comma-separated)",
        )  # fmt: skip
    p.add_argument("--secret", help="shared worker secret (prefer --secret-file)")
    p.add_argument("--secret-file", type=Path)
    p.add_argument("--redis", help="redis://HOST:PORT/DB shared by router replicas")
    p.add_argument(
        "--redis-deadline-s", type=float,
        help="longest a request waits for Redis before it is routed on local state (0.25)",
    )  # fmt: skip
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"accepted client key (repeatable; also read from ${API_KEYS_ENV})",
    )
    p.add_argument("--link-gbps", type=float, help="declared WAN bandwidth P -> MD")
    p.add_argument("--link-rtt-ms", type=float, help="declared WAN round-trip time")
    p.add_argument("--ttft-budget-s", type=float, help="TTFT budget the P-MD path must meet")
    p.add_argument(
        "--prefill-tokens-per-s", type=float,
        help="P's prefill throughput before any is measured (the prior)",
    )  # fmt: skip
    p.add_argument(
        "--static-link-view", action="store_true", default=None,
        help="decide on the declared link and prefill rate only, learning nothing "
        "(a baseline for benchmarks; the KV backlog is still counted)",
    )  # fmt: skip
    p.add_argument(
        "--kv-bytes-per-token", type=int,
        help="KV bytes per token on the WAN (default: the checkpoint's shape and --kv-codec)",
    )  # fmt: skip
    p.add_argument(
        "--kv-codec", choices=KV_CODECS, help="how P codes the KV it sends MD (default none)"
    )
    p.add_argument("--block-size", type=int)
    p.add_argument(
        "--instance-capacity",
        type=int,
        help="cap on requests per instance before 429 (default: each worker's reported capacity)",
    )
    p.add_argument("--max-prompt-tokens", type=int)
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--default-max-tokens", type=int)
    p.add_argument(
        "--max-tokens-limit", type=int, help="most output tokens a request may ask for (400 above)"
    )
    p.add_argument(
        "--max-streams-per-key", type=int,
        help="requests one API key may have in flight (429 above; without keys: all clients)",
    )  # fmt: skip
    p.add_argument(
        "--max-inflight-requests", type=int,
        help="requests in flight, all keys together, before new ones queue (fair per key)",
    )  # fmt: skip
    p.add_argument(
        "--admission-wait-s", type=float,
        help="longest a request queues for a slot before its 429 (default: 0.5)",
    )  # fmt: skip
    p.add_argument("--poll-interval-s", type=float)
    p.add_argument("--request-timeout-s", type=float)
    p.add_argument("--handoff", choices=("auto", "one-shot", "catch-up"))
    p.add_argument("--catchup-threshold", type=int)
    p.add_argument(
        "--force-pipeline",
        choices=("naive",),
        help="baseline for benchmarks: every request P -> MD with the full KV, no DRC",
    )
    p.add_argument(
        "--wan-tls-dir", type=Path,
        help="WAN TLS is on: a folder with the deployment's ca.crt; the workers reached "
        "across the WAN (main) are dialled with https and must chain to it",
    )  # fmt: skip
    p.add_argument(
        "--tool-call-format",
        type=ToolCallFormat,
        choices=list(ToolCallFormat),
        help="how the model writes tool calls (default: detected from its chat template)",
    )
    p.add_argument("--replica-id", help="this replica's name in the shared store")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--log-level", default="INFO")
    return p


#: Flags copied to RouterConfig fields when given (same name, dashes to underscores).
_PLAIN_FLAGS = (
    "model", "served_model_name", "link_gbps", "link_rtt_ms", "ttft_budget_s",
    "prefill_tokens_per_s", "kv_bytes_per_token", "block_size", "instance_capacity",
    "max_prompt_tokens", "max_body_bytes", "default_max_tokens", "poll_interval_s",
    "max_tokens_limit", "max_streams_per_key", "max_inflight_requests", "admission_wait_s",
    "request_timeout_s", "handoff", "catchup_threshold", "replica_id", "host", "port",
    "force_pipeline", "redis_deadline_s", "wan_tls_dir", "kv_codec", "tool_call_format",
    "static_link_view",
)  # fmt: skip


def build_config(args: argparse.Namespace) -> RouterConfig:
    settings: dict[str, Any] = {}
    secret_env = SHARED_SECRET_ENV
    if args.config is not None:
        try:
            doc = read_config_document(args.config, "router")
            settings = file_settings(doc, wan_tls=args.wan_tls_dir is not None)
        except ConfigDocumentError as exc:
            raise ConfigError(str(exc)) from None
        secret_env = settings.pop("secret_env")
    settings.update({k: getattr(args, k) for k in _PLAIN_FLAGS if getattr(args, k) is not None})
    workers = tuple(
        parse_worker(role, item)
        for role in Role
        for flag in getattr(args, role)
        for item in flag.split(",")
        if item
    )
    if workers:
        settings["workers"] = workers
    if args.redis:
        settings["redis_url"] = args.redis
    settings["api_keys"] = tuple(args.api_key) + env_api_keys()
    settings["secret"] = read_secret(args.secret, args.secret_file, secret_env)
    settings.setdefault("workers", ())
    return RouterConfig(**settings)


def env_api_keys() -> tuple[str, ...]:
    """Keys from the environment (a Secret in a pod): separated by commas, spaces or newlines."""
    return tuple(os.environ.get(API_KEYS_ENV, "").replace(",", " ").split())


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per worker poll otherwise
    try:
        config = build_config(args)
        runtime = RouterRuntime(config)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 2
    log.info("serving %r on %s:%d", config.served_name, config.host, config.port)
    uvicorn.run(create_app(runtime), host=config.host, port=config.port, log_level="warning")
    return 0
