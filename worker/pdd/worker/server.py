"""``pdd worker``: one worker instance (prefill | relay | main | mono).

One process is one engine driven by one engine thread, plus an asyncio loop
that serves the HTTP control API (uvicorn) and the data-plane transport (KV
chunks, token-ID handoffs). Startup order: load the model, start the engine
thread, listen on the data port, then serve HTTP; ``/ready`` turns true once
all of it is up. Engine settings this machine refuses (``EngineConfigError``: bfloat16
on a CPU without it, CUDA where none is visible), and WAN TLS files that do not load
(``TlsConfigError``: a Secret without ca.crt, a key that is not the certificate's), do
not end the process: it serves
``pdd.worker.refused_config`` on the HTTP address instead, not ready, saying why.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch
import uvicorn
from pydantic import ValidationError

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.common.config_document import ConfigDocumentError, read_config_document
from pdd.common.gc_heap import freeze_startup_heap
from pdd.common.kv_codec import KVCodecSetting, parse_kv_codec_setting
from pdd.common.logs import add_log_flags, configure_logging
from pdd.common.settings import add_settings, settings_of
from pdd.common.settings import parser as settings_parser
from pdd.common.tracing import TracingConfigError, add_tracing_flags, config_from, configure
from pdd.common.vocabulary import Role, datacenter
from pdd.common.wire import WorkerRefusal
from pdd.worker.deploy_config import document_values, given_dests
from pdd.worker.engine import Engine, EngineConfigError
from pdd.worker.engine.device import SYSTEM_PROBE, DeviceProbe
from pdd.worker.engine.kv_codec import fp8_supported
from pdd.worker.engine_runner import EngineRunner, ThreadEngineRunner
from pdd.worker.instance import WorkerInstance
from pdd.worker.options import (
    ENGINE_FIELDS,
    IDENTITY_FIELDS,
    KV_SIZE_FIELDS,
    VLLM_FIELDS,
    WORKER_WAN_SETTINGS,
    WorkerOptions,
)
from pdd.worker.refused_config import ENGINE_SETTINGS, WAN_TLS_FILES, serve_refused
from pdd.worker.roles.base import WorkerSettings
from pdd.worker.roles.protocol import split_addr
from pdd.worker.transport import TlsConfigError, WanTls, load_wan_tls
from pdd.worker.vllm.offline import VllmNotInstalledError
from pdd.worker.vllm.startup import host_files, start_stoppably
from pdd.worker.vllm.worker_config import (
    VllmWorkerConfigError,
    remove_dead_workers_files,
    vllm_settings,
)

log = logging.getLogger("pdd.worker")


class ConfigError(ValueError):
    """A command-line option is missing or inconsistent; the message says which."""


#: The worker's options table: ``WorkerOptions``' fields that are flags.
OPTIONS = settings_of(WorkerOptions)


def build_parser() -> argparse.ArgumentParser:
    """``pdd worker``'s flags, generated from ``WorkerOptions`` (grouped for ``--help``)."""
    p = settings_parser("pdd worker", __doc__.splitlines()[0])
    p.add_argument(
        "--config",
        type=Path,
        default=os.environ.get("PDD_CONFIG"),
        help="the operator's rendered config.json (else $PDD_CONFIG); flags override it",
    )
    add_settings(p, OPTIONS, only=IDENTITY_FIELDS)
    secret_env = WorkerOptions.model_fields["secret_env"].default
    p.add_argument("--secret-env", default=secret_env, help=argparse.SUPPRESS)
    engine = p.add_argument_group(
        "engine (the settings table pdd.common.config_document.EngineSettings, also the "
        "CRD's spec.engine; the config document gives the defaults, flags win)"
    )
    add_settings(engine, OPTIONS, only=ENGINE_FIELDS - KV_SIZE_FIELDS)
    add_settings(engine.add_mutually_exclusive_group(), OPTIONS, only=KV_SIZE_FIELDS)
    add_settings(engine, OPTIONS, only={"block_size"})
    add_settings(p, OPTIONS, only={"handoff", "catchup_load_level"})
    wan = p.add_argument_group(
        "how KV crosses the WAN (the settings table pdd.common.config_document.WanKVSettings, "
        "also the CRD's spec.wan; the config document gives the defaults, flags win; under "
        "adaptive MD takes whichever codec the router names per request)"
    )
    add_settings(wan, OPTIONS, only=WORKER_WAN_SETTINGS)
    add_settings(p, OPTIONS, only={"drain_seconds", "drain_notice_seconds", "engine"})
    vllm = p.add_argument_group("--engine vllm (vLLM's own flag names)")
    add_settings(vllm, OPTIONS, only=VLLM_FIELDS)
    add_log_flags(p)
    add_tracing_flags(p)
    return p


def parse_args(argv: list[str]) -> WorkerOptions:
    """Flags, over the operator's config file (if any), over the options' defaults.

    The document's typed values go into the options as they are (no argparse default, no
    second parse of them); a flag given on the command line keeps its value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values = {name: getattr(args, name) for name in WorkerOptions.model_fields}
    if args.config is not None:
        try:
            doc = read_config_document(args.config, "worker")
        except ConfigDocumentError as exc:
            parser.error(str(exc))
        given = given_dests(parser, argv)
        from_file = document_values(doc, os.environ, args.role)
        if given & KV_SIZE_FIELDS:
            # A KV size on the command line replaces the file's, whichever way each sizes it.
            from_file = {k: v for k, v in from_file.items() if k not in KV_SIZE_FIELDS}
        values.update({k: v for k, v in from_file.items() if k not in given})
    for name, flag in (("role", "--role"), ("instance_id", "--instance-id")):
        if values[name] is None:
            parser.error(f"{flag} is required (or --config with ${'PDD_' + name.upper()} set)")
    try:
        return WorkerOptions.model_validate(values)
    except ValidationError as exc:
        parser.error(invalid_options(exc))


def invalid_options(exc: ValidationError) -> str:
    """Each refused value by its flag, e.g. ``--kv-cache-gib: Input should be greater
    than 0``."""
    return "; ".join(
        f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}" for err in exc.errors()
    )


def read_secret(path: Path | None, env_name: str) -> str:
    secret = path.read_text().strip() if path else os.environ.get(env_name, "")
    if not secret:
        raise ConfigError(f"no shared secret: pass --secret-file F or set {env_name}")
    return secret


def build_settings(options: WorkerOptions) -> WorkerSettings:
    """The worker's settings; raises ``ConfigError`` (no secret) or ``TlsConfigError``."""
    return WorkerSettings(
        role=Role(options.role),
        instance_id=options.instance_id,
        secret=read_secret(options.secret_file, options.secret_env),
        handoff=options.handoff,
        catchup_load_level=options.catchup_load_level,
        transfer_timeout_s=options.transfer_timeout_seconds,
        advertise_fast=options.advertise_fast or options.data,
        advertise_wan=options.advertise_wan
        or options.wan
        or options.advertise_fast
        or options.data,
        http=options.advertise_http or options.http,
        wan_tls=wan_tls(options),
        kv_codec=kv_codec(options),
    )


def kv_codec(options: WorkerOptions) -> KVCodecSetting:
    """``--kv-codec``, refused when this torch cannot code it (fp8 needs float8 e4m3)."""
    codec = parse_kv_codec_setting(options.kv_codec)
    if codec == "fp8" and not fp8_supported():
        raise ConfigError(
            f"--kv-codec fp8 needs torch with float8_e4m3fn (this is torch {torch.__version__}); "
            "use int8"
        )
    return codec


def wan_tls(options: WorkerOptions) -> WanTls | None:
    """The WAN TLS contexts from ``--wan-tls-dir``; None without it."""
    if options.wan_tls_dir is None:
        return None
    if options.wan is None:
        raise TlsConfigError("--wan-tls-dir needs --wan: TLS is served on the WAN port only")
    return load_wan_tls(options.wan_tls_dir)


def build_engine(options: WorkerOptions, probe: DeviceProbe = SYSTEM_PROBE) -> Engine:
    return Engine(
        options.model,
        probe=probe,
        dtype=options.dtype,
        device=options.device,
        block_size=options.block_size or DEFAULT_BLOCK_SIZE,
        num_blocks=options.num_blocks,
        kv_budget_bytes=None
        if options.kv_cache_gib is None
        else round(options.kv_cache_gib * 2**30),
        kv_cache_memory_fraction=options.kv_cache_memory_fraction,
        max_running_requests=options.max_running_requests,
        max_model_len=options.max_model_len,
        max_prompt_tokens=options.max_prompt_tokens,
        max_num_batched_tokens=options.max_num_batched_tokens,
    )


async def build_runner(options: WorkerOptions, probe: DeviceProbe = SYSTEM_PROBE) -> EngineRunner:
    """The engine and its driver: the pdd engine on its thread, or (``--engine vllm``)
    vLLM's AsyncLLM on this loop (``pdd.worker.vllm.serving``, imported only then; P, RLD
    and MD with the KV moves of ``role_engine``)."""
    loop = asyncio.get_running_loop()
    if options.engine == "vllm":
        from pdd.worker.vllm import role_engine, serving

        for path in remove_dead_workers_files():
            log.info("removed %s, left by a worker that no longer runs", path)
        try:
            settings = vllm_settings(options)
            moves_kv = settings.kv_store_dir is not None
            start = role_engine.start_role_engine if moves_kv else serving.start_engine
            engine = await start_stoppably(
                lambda: start(settings, options.router_block_size),
                host_files(settings),
            )
        except (VllmWorkerConfigError, VllmNotInstalledError) as exc:
            raise ConfigError(str(exc)) from exc
        return serving.VllmRunner(engine, loop)
    return ThreadEngineRunner(build_engine(options, probe), loop)


async def run(options: WorkerOptions, probe: DeviceProbe = SYSTEM_PROBE) -> None:
    try:
        settings = build_settings(options)
        runner = await build_runner(options, probe)
    except (EngineConfigError, TlsConfigError) as exc:
        # Stay up, not ready, saying why: exiting would crash-loop the pod (refused_config).
        refusal = WorkerRefusal(
            role=options.role, instance_id=options.instance_id, problem=str(exc)
        )
        tls = isinstance(exc, TlsConfigError)
        await serve_refused(refusal, options.http, WAN_TLS_FILES if tls else ENGINE_SETTINGS)
        return
    worker = WorkerInstance(settings, runner)
    await worker.start(options.data, options.wan)
    http_host, http_port = split_addr(options.http)
    server = DrainingServer(
        uvicorn.Config(
            worker.app,
            host=http_host,
            port=http_port,
            log_level="warning",
            log_config=None,  # uvicorn's lines through this process's handler (escaped, JSON)
            lifespan="off",
            ssl_context_factory=http_tls(settings),
        ),
        worker,
        options.drain_seconds,
        options.drain_notice_seconds,
    )
    assert worker.data is not None
    info = worker.role.engine_info
    log.info(
        "%s %s: data on %s, port %d, WAN data %s, %s on %s; engine on %s %s (%s), CPU "
        "kernels %s, KV %d blocks "
        "x %d = %d tokens (%.2f GiB), max running %d, max prompt %d tokens, chunked prefill "
        "%d tokens",
        options.role,
        settings.instance_id,
        options.data,
        worker.data.port,
        f"on port {worker.wan.port}{tls_words(settings.wan_tls)}"
        if worker.wan
        else "on the same port",
        settings.http_scheme,
        options.http,
        info.device,
        info.dtype,
        info.dtype_reason,
        info.cpu_kernels or "none (torch's ops)",
        info.kv_blocks,
        info.block_size,
        info.kv_tokens,
        info.kv_bytes / 2**30,
        info.max_running_requests,
        info.max_prompt_tokens,
        info.max_num_batched_tokens,
    )
    freeze_startup_heap()  # the model, the app and the libraries: never garbage
    try:
        await server.serve()
    finally:
        await worker.stop()


def http_tls(settings: WorkerSettings) -> Callable[..., ssl.SSLContext] | None:
    """uvicorn's TLS for the control API where the router reaches it across the WAN.

    A factory returning the context ``load_wan_tls`` built, rather than uvicorn's file
    options: that context pins TLS 1.3 and its files were checked at start (a bad Secret
    is a refused config, not a crash in uvicorn)."""
    tls = settings.wan_tls
    if tls is None or not settings.serves_https:
        return None
    return lambda _config, _default: tls.http_server


def tls_words(tls: WanTls | None) -> str:
    """How the WAN port is secured, for the startup log line."""
    if tls is None:
        return " (plaintext)"
    return " (TLS 1.3, mutual)" if tls.mutual else " (TLS 1.3, server certificate only)"


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM (what Kubernetes sends a pod it removes) drains first.

    The first SIGTERM starts ``WorkerInstance.drain``; the HTTP server keeps answering
    (streams, handoffs, the router's polls that see ``draining``) and exits once nothing
    is live or ``grace_s`` passed. A second SIGTERM, or SIGINT, stops at once."""

    def __init__(
        self, config: uvicorn.Config, worker: WorkerInstance, grace_s: float, notice_s: float
    ) -> None:
        super().__init__(config)
        self._worker = worker
        self._grace_s = grace_s
        self._notice_s = notice_s
        self._drain_requested = False
        self._tasks: set[asyncio.Task[bool]] = set()
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: runs between bytecodes, so only flag and hand over to the loop.
        if sig == signal.SIGTERM and not self._drain_requested and not self.should_exit:
            self._drain_requested = True
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        log.info("SIGTERM: draining (up to %.0f s)", self._grace_s)
        drain = asyncio.ensure_future(self._worker.drain(self._grace_s, self._notice_s))
        self._tasks.add(drain)  # held: the loop keeps only weak references to tasks
        drain.add_done_callback(lambda _: setattr(self, "should_exit", True))


def configure_tracing(options: WorkerOptions) -> None:
    """Spans as ``pdd-<role>`` (``OTEL_SERVICE_NAME`` overrides), naming the instance
    and its datacenter; ``OTEL_RESOURCE_ATTRIBUTES`` adds the pool and the rest."""
    attributes = {
        "pdd.role": options.role,
        "pdd.datacenter": datacenter(options.role),
        "service.instance.id": options.instance_id,
    }
    service = f"pdd-{options.role}"
    configure(config_from(service, options.otlp_traces_endpoint, options.traces_file, attributes))


def main(argv: list[str], probe: DeviceProbe = SYSTEM_PROBE) -> int:
    """``pdd worker``; ``probe`` stands in for the machine (tests fake a CPU or a GPU)."""
    options = parse_args(argv)
    configure_logging(options.log_level, options.log_format)
    try:
        configure_tracing(options)
    except TracingConfigError as exc:
        log.error("%s", exc)
        return 2
    if options.torch_threads:
        torch.set_num_threads(options.torch_threads)
    try:
        asyncio.run(run(options, probe))
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        pass
    return 0
