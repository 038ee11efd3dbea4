"""``pdd operator``: run the PDDDeployment operator against the current API server.

The API server is found the ordinary way (in-cluster service account, else KUBECONFIG
or ~/.kube/config), so the same command runs in a pod, on a laptop against kind, or
in tests against an emulator.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

import kopf

from pdd.common.logs import add_log_flags, configure_logging
from pdd.common.settings import parser as settings_parser
from pdd.operator.default_tracing import add_default_tracing_flags, default_tracing
from pdd.operator.runtime import OperatorOptions


def build_parser() -> argparse.ArgumentParser:
    """``pdd operator [flags]`` runs the operator; ``pdd operator render`` and ``pdd operator
    crd`` are verbs with their own flags (``pdd.operator.render``, ``pdd.operator.crd``)."""
    parser = settings_parser("pdd operator", __doc__)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", title="verbs")
    verbs.add_parser(
        "render",
        add_help=False,
        help="print or write the manifests of the PDDDeployments in a file, without a "
        "cluster (pdd operator render --help)",
    )
    verbs.add_parser(
        "crd",
        add_help=False,
        help="print the PDDDeployment CustomResourceDefinition, generated from the spec models "
        "(crds/pdddeployments.yaml is its output)",
    )
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
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging (same as --log-level debug)"
    )
    add_log_flags(parser)
    parser.add_argument(
        "--status-interval",
        type=float,
        default=OperatorOptions.status_interval_s,
        help="seconds between readiness reads of an MD in cluster B while it changes, "
        "backing off to 5 minutes while it does not (cluster A's children are watched)",
    )
    add_default_tracing_flags(parser)
    parser.add_argument(
        "--planner-metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the SLO planner's pdd_planner_desired_replicas on http://0.0.0.0:PORT/metrics "
        "for the metrics adapter behind each role's HPA (docs/planner.md); default: not served",
    )
    parser.add_argument(
        "--planner-scenario",
        default=OperatorOptions.planner_scenario,
        metavar="NAME|FILE",
        help="the scenario whose step model (GPUs, model, pool shapes) the planner sizes "
        "with: a shipped name or a YAML file written out in full (no extends)",
    )
    parser.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz",
    )
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["render"]:
        from pdd.operator import render

        return render.main(argv[1:])
    if argv[:1] == ["crd"]:
        from pdd.operator import crd

        return crd.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging("DEBUG" if args.verbose else args.log_level, args.log_format)
    import pdd.operator.handlers  # noqa: F401  (registers the handlers with kopf)

    options = OperatorOptions(
        status_interval_s=args.status_interval,
        default_tracing=default_tracing(parser, args),
        planner_scenario=args.planner_scenario,
        planner_metrics_port=args.planner_metrics_port,
    )
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
