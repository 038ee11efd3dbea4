"""``pdd up``: the whole pipeline on this machine, until Ctrl-C.

    pdd up --model smollm2-135m-instruct --mode pdd --port 8080

Renders the PDDDeployment that the flags describe with the operator's own renderer and
runs the chosen mode's pods as local processes, with the emulated WAN lines between
the two datacenters (see ``topology``, ``stack``), each health-gated with progress on
the terminal; prints the OpenAI base URL and a curl to paste. A child that exits
is reported with its log's tail (and, unless ``--keep-going``, stops the stack).
SIGINT or SIGTERM stops every child and returns.

Client keys (``--api-key-file PATH``, else ``$PDD_API_KEYS``): the router takes only
those. They reach it as a cluster gives them, through the rendered Secret into its
environment, never on a command line (``ps`` shows every user those), and the printed
curl sends ``Authorization: Bearer`` with a shell expression that reads a key (the
file's first, or ``$PDD_API_KEYS``), not the key itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdd.common.api_keys import ApiKeyFileError, env_api_keys, read_api_key_file
from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.common.config_document import API_KEYS_ENV, SloFlags, StoreSection, WanKVSettings
from pdd.common.model_store import (
    BUILTINS,
    DEFAULT_MODEL,
    TINY,
    ModelNotPulledError,
    default_model,
    resolve_model,
)
from pdd.common.settings import add_settings, settings_of
from pdd.common.settings import parser as settings_parser
from pdd.common.tracing import TRACES_FILE, TRACES_FILE_ENV
from pdd.common.vocabulary import PDD_ROLES, Role
from pdd.common.wan_line import add_line_flags, parsed_line
from pdd.local.autoscale import (
    AutoscaleError,
    Autoscaler,
    add_autoscale_flags,
    for_stack,
    settings_from_args,
    sized_config,
)
from pdd.local.cluster import LinkSpec
from pdd.local.stack import LocalStack, StackStartError
from pdd.local.supervisor import interrupted_by_stop_signals
from pdd.local.topology import MODES, Counts, StackConfig, TopologyError, mode_workers

#: The engines a worker runs (``pdd worker --engine``).
ENGINES = ("pdd", "vllm")
#: The line's settings ``pdd up`` takes (a local stack's cut keeps ``LinkSpec``'s grace).
LINE_FLAGS = frozenset({"gbps", "rtt_ms", "jitter_ms"})


def add_stack_flags(
    p: argparse.ArgumentParser, default_log_dir: Path | None, budget_default: str | None = None
) -> None:
    """Flags shared by ``pdd up`` and ``pdd bench`` (which brings stacks up itself);
    ``budget_default``: what an unset ``--ttft-budget-s`` becomes where that is not the CRD's
    default (``pdd bench`` gives its routers its SLO)."""
    d = StackConfig()
    p.add_argument(
        "--model", default=None,
        help=f"a built-in ({', '.join(BUILTINS)}; default {DEFAULT_MODEL} where pulled, else "
        f"{TINY!r}: random weights, for tests), ORG/REPO pulled with `pdd models pull`, a "
        "checkpoint directory or a GGUF file",
    )  # fmt: skip
    p.add_argument("--host", default=d.host, help="address every process listens on")
    p.add_argument(
        "--engine", choices=ENGINES, default="pdd",
        help="every worker's engine but where a --<role>-engine says otherwise: PDD's own, "
        "or vLLM's AsyncLLM (the pdd[vllm] extra; vLLM's flags through --worker-arg, e.g. "
        "--worker-arg=--dtype=float32, or a role's --<role>-arg)",
    )  # fmt: skip
    for tier in PDD_ROLES:
        p.add_argument(
            f"--{tier}-engine", choices=ENGINES, default=None,
            help=f"the {tier} workers' engine (default: --engine's); tiers on different "
            "engines exchange the same KV chunks, all in one --dtype (docs/vllm.md)",
        )  # fmt: skip
    for role in ("prefill", "relay", "main", "mono"):
        p.add_argument(f"--{role}", type=int, default=1, metavar="N", help=f"{role} workers")
    # The WAN line's settings (``WanLine``, as pdd wan-link and pdd router have them), their
    # defaults the line pdd up runs where none is given (sized for the tiny model).
    add_line_flags(p, d.link, only=LINE_FLAGS)
    p.add_argument(
        "--wan-tls", action="store_true",
        help="TLS 1.3 on the channels between the datacenters (spec.wan.tls; a CA and "
        "certificate are generated for the run)",
    )  # fmt: skip
    # spec.wan.kvCodec: the WAN settings' field, its help, default and choices.
    add_settings(p, settings_of(WanKVSettings), only={"kv_codec"})
    # spec.router.redisUrl: the router's store setting (the config document's store.redisUrl).
    add_settings(p, settings_of(StoreSection))
    # spec.slo.ttftP99Ms, in seconds: the router's --ttft-budget-s. Unset, it writes no slo
    # and the router runs on the CRD's default, which the help shows.
    slo = settings_of(SloFlags)
    if budget_default is not None:
        slo = [dataclasses.replace(s, default=None, default_text=budget_default) for s in slo]
    add_settings(p, slo, flag_defaults=False)
    p.add_argument(
        "--log-dir", type=Path, default=default_log_dir,
        help="per-pod logs, the PDDDeployment and its render go here",
    )  # fmt: skip
    p.add_argument(
        "--ready-timeout-s", type=float, default=d.ready_timeout_s,
        help="longest to wait for every process to be ready",
    )  # fmt: skip
    p.add_argument(
        "--worker-arg", action="append", default=[], metavar="ARG",
        help="extra argument for every worker, e.g. --worker-arg=--kv-cache-gib=0.0625",
    )  # fmt: skip
    for role in Role:
        p.add_argument(
            f"--{role}-arg", action="append", default=[], metavar="ARG",
            help=f"extra argument for the {role} workers only, after --worker-arg's, "
            f"e.g. --{role}-arg=--max-num-seqs=4",
        )  # fmt: skip
    p.add_argument(
        "--router-arg", action="append", default=[], metavar="ARG",
        help="extra argument for the router, e.g. --router-arg=--log-level=debug",
    )  # fmt: skip


def stack_config(args: argparse.Namespace, mode: str, port: int, log_dir: Path) -> StackConfig:
    check_block_sizes(args)
    check_mixed_dtypes(args, mode)
    return StackConfig(
        mode=mode,  # type: ignore[arg-type]
        model=stack_model(args.model),
        host=args.host,
        port=port,
        counts=Counts(args.prefill, args.relay, args.main, args.mono),
        link=parsed_line(args, LinkSpec),
        redis_url=args.redis,
        log_dir=log_dir,
        worker_args=tuple(args.worker_arg),
        role_args=role_args(args),
        router_args=tuple(args.router_arg),
        ready_timeout_s=args.ready_timeout_s,
        ttft_budget_s=args.ttft_budget_s,
        wan_tls=args.wan_tls,
        kv_codec=args.kv_codec,
    )


def role_args(args: argparse.Namespace) -> tuple[tuple[Role, tuple[str, ...]], ...]:
    """Each role's own flags: its engine's (``role_engine``), then its ``--<role>-arg``s."""
    return tuple(
        (role, engine_worker_args(role_engine(args, role), args.router_arg)
         + tuple(getattr(args, f"{role}_arg")))
        for role in Role
    )  # fmt: skip


def role_engine(args: argparse.Namespace, role: Role) -> str:
    """The engine ``role``'s workers run: its own ``--<role>-engine``, else ``--engine``
    (mono has no flag of its own: it is the single-engine baseline)."""
    own: str | None = getattr(args, f"{role}_engine", None)
    return args.engine if own is None else own


def engine_worker_args(engine: str, router_args: Sequence[str] = ()) -> tuple[str, ...]:
    """A worker's ``--engine`` flag (every role runs on either engine, in every mode).
    A vLLM worker also gets the router's block size, the blocks it names vLLM's cached
    blocks in for the router's prefix index (``--router-block-size``)."""
    if engine == "pdd":
        return ()
    return (f"--engine={engine}", f"--router-block-size={router_block_size(router_args)}")


def router_block_size(router_args: Sequence[str]) -> int:
    """The block size of the router ``pdd up`` starts: the last ``--block-size`` of its
    ``--router-arg``s, else the router's default."""
    given: int | None = last_flag(router_args, "--block-size", int)
    return DEFAULT_BLOCK_SIZE if given is None else given


def last_flag(flags: Sequence[str], name: str, kind: type = str) -> Any:
    """The value of the last ``name`` among ``flags`` (``--x V`` or ``--x=V``), if any."""
    p = argparse.ArgumentParser(prog="pdd up", add_help=False, allow_abbrev=False)
    p.add_argument(name, dest="value", type=kind, default=None)
    return p.parse_known_args(list(flags))[0].value


def check_block_sizes(args: argparse.Namespace) -> None:
    """Refuse pdd-engine workers given a ``--block-size`` the router does not index (it
    leaves such a worker out, so every request would fail), naming the router's flag.
    vLLM workers rename their blocks into the router's (``--router-block-size``)."""
    router = router_block_size(args.router_arg)
    for role in Role:
        if role_engine(args, role) != "pdd":
            continue
        flags = [*args.worker_arg, *getattr(args, f"{role}_arg")]
        worker: int | None = last_flag(flags, "--block-size", int)
        if worker is not None and worker != router:
            raise TopologyError(
                f"the {role} workers cache blocks of {worker} tokens but the router indexes "
                f"blocks of {router}: give it the same (--router-arg=--block-size={worker})"
            )


def check_mixed_dtypes(args: argparse.Namespace, mode: str) -> None:
    """Refuse a stack whose running tiers mix engines unless every worker is given one
    ``--dtype``: KV chunks cross only between workers of one dtype, and the engines'
    defaults differ (vLLM's ``auto`` runs a float32 checkpoint in 16 bits, the pdd engine
    in float32 on a CPU without native bfloat16): the receiver would refuse each chunk."""
    slots = mode_workers(mode, Counts())  # type: ignore[arg-type]  # one of MODES
    roles = list(dict.fromkeys(slot.role for slot in slots))
    engines = {role: role_engine(args, role) for role in roles}
    if len(set(engines.values())) < 2:
        return
    dtypes = {role: last_flag([*args.worker_arg, *getattr(args, f"{role}_arg")], "--dtype")
              for role in roles}  # fmt: skip
    if len(set(dtypes.values())) == 1 and dtypes[roles[0]] not in (None, "auto"):
        return
    running = ", ".join(f"{role}: {engine}" for role, engine in engines.items())
    given = ", ".join(f"{role}: {dtype or 'given none'}" for role, dtype in dtypes.items())
    raise TopologyError(
        f"the workers run on different engines ({running}), whose KV crosses only in one "
        "dtype and whose default dtypes differ: give every worker the same --dtype, not auto (e.g. "
        f"--worker-arg=--dtype=float32); --dtype per role: {given}"
    )


def stack_model(requested: str | None) -> str:
    """The model a stack serves: the default where none is named, a pulled name's folder."""
    if requested is None:
        return default_model(say)
    try:
        return resolve_model(requested)
    except ModelNotPulledError as e:
        raise TopologyError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd up", __doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, default="pdd", help="what runs (baselines too)")
    p.add_argument("--port", type=int, default=8080, help="the router's (OpenAI API) port")
    p.add_argument("--keep-going", action="store_true", help="report a dead child, keep serving")
    p.add_argument(
        "--api-key-file", type=Path,
        help=f"client keys the router takes, one per line (default: ${API_KEYS_ENV}'s, "
        "else none: open); they reach the router through its environment, never argv",
    )  # fmt: skip
    add_stack_flags(p, Path("pdd-logs"))
    add_autoscale_flags(p)
    p.add_argument(
        "--otlp-traces-endpoint",
        help="every process also sends its spans over OTLP to this URL (a Jaeger, Tempo or "
        "Collector; OTEL_EXPORTER_OTLP_* and OTEL_TRACES_SAMPLER* are honoured too)",
    )
    p.add_argument(
        "--no-traces-file", action="store_true",
        help="do not write LOG_DIR/traces.jsonl (the spans `pdd trace` reads)",
    )  # fmt: skip
    return p


def tracing_env(args: argparse.Namespace) -> dict[str, str]:
    """What every process of the stack inherits to trace: the file ``pdd trace`` reads
    (``LOG_DIR/traces.jsonl``) and the OTLP endpoint, where given."""
    env = {}
    if not args.no_traces_file:
        env[TRACES_FILE_ENV] = str((args.log_dir / TRACES_FILE).resolve())
    if args.otlp_traces_endpoint:
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = args.otlp_traces_endpoint
    return env


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def api_keys(args: argparse.Namespace) -> tuple[tuple[str, ...], str | None]:
    """The client keys and the shell expression the printed curl reads one with (None:
    no keys): the key file's first key, or ``$PDD_API_KEYS``; never the key itself."""
    if args.api_key_file is not None:
        path = shlex.quote(str(args.api_key_file.resolve()))
        return read_api_key_file(args.api_key_file), f"$(awk 'NF {{print $1; exit}}' {path})"
    keys = env_api_keys(os.environ)
    return keys, (f"${API_KEYS_ENV}" if keys else None)


def curl_example(base_url: str, model: str, key: str | None = None) -> str:
    """A curl to paste; ``key``: a shell expression for the key (double-quoted, so the
    shell that runs the curl reads it)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
    }
    auth = f' -H "Authorization: Bearer {key}"' if key is not None else ""
    return (
        f"curl -N {base_url}/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{json.dumps(body)}'"
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    with interrupted_by_stop_signals():
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    """Start the stack, watch it until stopped; stop every child on the way out."""
    stack = None
    try:
        keys, key_expression = api_keys(args)
        if any(arg.startswith("--api-key") for arg in args.router_arg):
            say(
                "pdd up: keys given through --router-arg show in ps and are not in the curl "
                "below; --api-key-file or $PDD_API_KEYS keep them out of every command line"
            )
        config = stack_config(args, args.mode, args.port, args.log_dir)
        config = dataclasses.replace(config, api_keys=keys)
        settings = settings_from_args(args, args.mode) if args.autoscale else None
        standby: set[str] = set()
        if settings is not None:
            config, standby = sized_config(config, settings)
        os.environ.update(tracing_env(args))  # the stack's processes inherit it
        stack = LocalStack.start(config, say, standby)
        autoscaler = None if settings is None else for_stack(stack, settings, say)
        print(f"PDD ({args.mode}) is up. OpenAI base URL: {stack.info.base_url}", flush=True)
        print(curl_example(stack.info.base_url, stack.info.model, key_expression), flush=True)
        say("Ctrl-C stops everything.")
        return _watch(stack, args.keep_going, autoscaler)
    except (TopologyError, StackStartError, ApiKeyFileError, AutoscaleError) as exc:
        say(f"pdd up: {exc}")
        return 1
    except KeyboardInterrupt:
        say("stopping ...")
        return 0
    finally:
        if stack is not None:
            stack.stop()
            say("stopped; no child process left")


def _watch(stack: LocalStack, keep_going: bool, autoscaler: Autoscaler | None) -> int:
    while True:
        if autoscaler is not None:
            autoscaler.tick(time.monotonic())
        deaths = stack.supervisor.deaths()
        for death in deaths:
            say(f"pdd up: {death.describe()}")
        if deaths and not keep_going:
            say("pdd up: stopping the stack because a component died (see --keep-going)")
            return 1
        time.sleep(0.5)
