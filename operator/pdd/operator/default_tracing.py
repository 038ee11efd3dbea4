"""The operator's default spec.observability.tracing (the chart's ``tracing`` values).

A cluster usually has one OTLP Collector: the chart names it once and every
PDDDeployment this operator serves that sets no ``observability.tracing`` of its own
traces to it, as if its spec said so (a PDDDeployment's own setting wins).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from pdd.operator.spec import TRACING_ENDPOINT_PATTERN, Tracing


def add_default_tracing_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracing-endpoint",
        metavar="URL",
        help="OTLP traces endpoint for every PDDDeployment that sets no "
        "spec.observability.tracing (http:// or https://)",
    )
    parser.add_argument(
        "--tracing-sample-ratio",
        type=float,
        default=1.0,
        metavar="RATIO",
        help="with --tracing-endpoint: the share of requests traced, 0 to 1 (default: 1)",
    )


def default_tracing(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Tracing | None:
    """The flags as a spec section; a bad URL or ratio ends the process at start, in words."""
    if args.tracing_endpoint is None:
        return None
    if not re.fullmatch(TRACING_ENDPOINT_PATTERN, args.tracing_endpoint):
        parser.error(f"--tracing-endpoint {args.tracing_endpoint!r} is not an http(s) URL")
    if not 0 <= args.tracing_sample_ratio <= 1:
        parser.error(f"--tracing-sample-ratio {args.tracing_sample_ratio} is not in [0, 1]")
    return Tracing(endpoint=args.tracing_endpoint, sample_ratio=args.tracing_sample_ratio)


def with_default_tracing(raw_spec: dict[str, Any], default: Tracing | None) -> dict[str, Any]:
    """``raw_spec`` with ``default`` as its tracing where it sets none."""
    observability = raw_spec.get("observability") or {}
    if default is None or observability.get("tracing") is not None:
        return raw_spec
    tracing = default.model_dump(by_alias=True)
    return {**raw_spec, "observability": {**observability, "tracing": tracing}}
