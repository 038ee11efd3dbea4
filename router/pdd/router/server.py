"""``pdd router``: the OpenAI-compatible front door of a PDD deployment.

Flags, optionally on top of the operator's rendered config (``--config``); then one
uvicorn server around the app. Exit status 2 for a configuration error, with the
message saying what to fix.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import uvicorn

from pdd.common.api_keys import env_api_keys, read_api_key_file
from pdd.common.config_document import (
    API_KEYS_ENV,
    SHARED_SECRET_ENV,
    ConfigDocumentError,
    read_config_document,
)
from pdd.common.gc_heap import freeze_startup_heap
from pdd.common.logs import add_log_flags, configure_logging
from pdd.common.settings import add_settings, flag_values
from pdd.common.settings import parser as settings_parser
from pdd.common.tracing import add_tracing_flags, configure_from_args
from pdd.common.vocabulary import Role, datacenter
from pdd.router.app import create_app
from pdd.router.config import (
    ConfigError,
    RouterConfig,
    file_settings,
    parse_worker,
    read_secret,
    router_settings,
)
from pdd.router.runtime import RouterRuntime

log = logging.getLogger("pdd.router")


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd router", __doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="the operator's config.json (flags override it)")
    for role in Role:
        p.add_argument(
            f"--{role}", action="append", default=[], metavar="ID=URL",
            help=f"a {role} worker (repeatable, or comma-separated)",
        )  # fmt: skip
    p.add_argument("--secret", help="shared worker secret (prefer --secret-file)")
    p.add_argument(
        "--secret-file",
        type=Path,
        help=f"file holding the shared worker secret (else ${SHARED_SECRET_ENV})",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted client key (repeatable); shows in ps: prefer --api-key-file or "
        f"${API_KEYS_ENV}",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        help=f"file of accepted client keys, one per line (beside ${API_KEYS_ENV}'s: keys "
        "separated by newlines, commas or spaces)",
    )
    # The settings table (RouterConfig's fields): flags left unset take the config file's
    # value, else the table's default (shown in --help).
    add_settings(p, ROUTER_SETTINGS, flag_defaults=False)
    add_log_flags(p)
    add_tracing_flags(p)
    return p


#: The router's settings table: RouterConfig's fields that are flags, and the WAN's.
ROUTER_SETTINGS = router_settings()


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
    settings.update(flag_values(ROUTER_SETTINGS, args))  # the flags given
    workers = tuple(
        parse_worker(role, item)
        for role in Role
        for flag in getattr(args, role)
        for item in flag.split(",")
        if item
    )
    if workers:
        settings["workers"] = workers
    from_file = read_api_key_file(args.api_key_file) if args.api_key_file else ()
    settings["api_keys"] = tuple(args.api_key) + env_api_keys() + from_file
    settings["secret"] = read_secret(args.secret, args.secret_file, secret_env)
    settings.setdefault("workers", ())
    return RouterConfig(**settings)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        config = build_config(args)
        attributes = {"pdd.role": "router", "pdd.datacenter": datacenter("router")}
        configure_from_args(args, "pdd-router", attributes)
        runtime = RouterRuntime(config)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 2
    log.info("serving %r on %s:%d", config.served_name, config.host, config.port)
    app = create_app(runtime)
    freeze_startup_heap()  # the app and the libraries: never garbage
    # log_config=None: uvicorn's own lines go through this process's handler (escaped, JSON)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", log_config=None)
    return 0
