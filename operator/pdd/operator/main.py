"""``pdd operator``: run the PDDDeployment operator against the current API server.

The API server is found the ordinary way (in-cluster service account, else KUBECONFIG
or ~/.kube/config), so the same command runs in a pod, on a laptop against kind, or
in tests against an emulator.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from typing import Any

import kopf

from pdd.operator.runtime import OperatorOptions


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdd operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch PDDDeployments in this namespace (repeatable; glob patterns allowed)",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="watch every namespace (the default when no --namespace is given)",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        help="run as one of several replicas: they meet in the ClusterKopfPeering NAME and "
        "only the one with the highest (random) priority reconciles; the others stand by",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--status-interval",
        type=float,
        default=OperatorOptions.status_interval_s,
        help="seconds between readiness reads of an MD in cluster B while it changes, "
        "backing off to 5 minutes while it does not (cluster A's children are watched)",
    )
    parser.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["render"]:
        from pdd.operator import render

        return render.main(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import pdd.operator.handlers  # noqa: F401  (registers the handlers with kopf)

    options = OperatorOptions(status_interval_s=args.status_interval)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(options=options),
        **peering_options(args.peering),
    )
    return 0


def peering_options(name: str | None) -> dict[str, Any]:
    """kopf's peering for replicas: without a name one replica runs alone (standalone).

    With a name, kopf pauses every replica that sees a live peer of higher priority, and all
    of them when two share one; a random priority per process makes that one replica
    active. A replica that stops cleanly leaves at once; one that dies is presumed gone
    once its keep-alive expires (kopf's peering lifetime, 60 s), then the next one resumes.
    """
    if name is None:
        return {"standalone": True}
    return {
        "standalone": False,
        "peering_name": name,
        "priority": random.SystemRandom().randint(1, 2**31 - 1),
    }
