"""``pdd operator render``: what the operator would write, without a cluster.

    pdd operator render -f examples/node-pools.yaml > rendered.yaml
    pdd operator render -f examples/two-clusters.yaml --out-dir rendered/
    pdd operator render -f examples/two-clusters.yaml --cluster remote | kubectl apply -f -

Reads the PDDDeployments of a YAML file, validates each as the operator does and
builds the same plan (``build_plan``), then writes one ``kind: List`` per cluster:
``local.yaml`` for cluster A and, with ``remoteCluster``, ``remote.yaml`` for B. Standard
output takes one cluster only (``--cluster``, needed when there are two), so a pipe into
``kubectl apply`` can never put one cluster's objects into the other. It is how GitOps
users review what a spec becomes, and what the local pod runner (``pdd.testing.pods``)
starts, so the manifests the operator renders are the ones that run in our tests.

A render is deterministic: the same file gives the same bytes, so it can be kept in Git
and diffed. It holds no key material: the Secrets the operator generates once (the
peers' shared token; the WAN TLS CA and certificate unless ``wan.tls.secretName`` names
one) are referenced by name only. The operator creates them on its first reconcile;
without the operator, ``--secrets`` prints them, freshly generated, once, to apply
directly (never to keep in Git).

Without a ``metadata.uid`` in the file (a PDDDeployment not yet in a cluster) the
children carry no owner reference: one naming a made-up uid would make Kubernetes'
garbage collector delete them as orphans.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from pdd.common.settings import parser as settings_parser
from pdd.operator.builders.config import new_shared_token
from pdd.operator.builders.wan_tls import generates_wan_tls, new_wan_tls
from pdd.operator.naming import API_VERSION, KIND, Owner
from pdd.operator.plan import Cluster, build_plan, generated_secret_names
from pdd.operator.spec import PDDSpec
from pdd.operator.validation import InvalidSpecError, parse_spec

Rendered = dict[Cluster, list[dict[str, Any]]]


def render_deployment(doc: dict[str, Any], secrets_token: str | None = None) -> Rendered:
    """One PDDDeployment's children by cluster, in write order; InvalidSpecError if invalid.

    ``secrets_token``: None renders the workloads, which name the generated Secrets
    without holding them; a token renders only those Secrets, with that token and fresh
    WAN TLS material (what the operator generates on its first reconcile)."""
    owner, spec = _parse(doc)
    if secrets_token is None:
        plan = build_plan(spec, owner, None)
        wanted = plan.children
    else:
        tls = new_wan_tls(owner.name) if generates_wan_tls(spec) else None
        plan = build_plan(spec, owner, secrets_token, tls)
        names = set(generated_secret_names(spec, owner))
        wanted = tuple(
            (cluster, obj)
            for cluster, obj in plan.children
            if obj["kind"] == "Secret" and obj["metadata"]["name"] in names
        )
    by_cluster: Rendered = defaultdict(list)
    for cluster, obj in wanted:
        if not owner.uid:
            obj = copy.deepcopy(obj)
            obj["metadata"].pop("ownerReferences", None)
        by_cluster[cluster].append(obj)
    return dict(by_cluster)


def _parse(doc: dict[str, Any]) -> tuple[Owner, PDDSpec]:
    """The owner and the validated spec, refusing an apiVersion the CRD does not serve."""
    meta = doc.get("metadata") or {}
    name = meta.get("name")
    if doc.get("apiVersion") != API_VERSION:
        raise InvalidSpecError(
            [
                f"{KIND} {name or '(unnamed)'}: apiVersion {doc.get('apiVersion')!r} is not "
                f"served; the CRD serves {API_VERSION}"
            ]
        )
    if not name:
        raise InvalidSpecError([f"a {KIND} without metadata.name"])
    namespace = meta.get("namespace") or "default"
    owner = Owner(name=name, namespace=namespace, uid=meta.get("uid") or "")
    return owner, parse_spec(dict(doc.get("spec") or {}), owner.name)


def render_file(text: str, secrets_token: str | None = None) -> Rendered:
    """Every PDDDeployment of a multi-document YAML text, rendered and merged by cluster
    (``secrets_token``: as in ``render_deployment``)."""
    merged: Rendered = defaultdict(list)
    found = 0
    for doc in yaml.safe_load_all(text):
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            continue
        found += 1
        for cluster, objs in render_deployment(doc, secrets_token).items():
            merged[cluster] += objs
    if not found:
        raise InvalidSpecError([f"no {KIND} in the file: nothing to render"])
    return dict(merged)


def as_list(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``kind: List`` that ``kubectl apply -f`` takes as it is."""
    return {"apiVersion": "v1", "kind": "List", "items": objs}


def dump(objs: list[dict[str, Any]]) -> str:
    """The YAML text of one cluster's List (block style, keys in build order)."""
    return yaml.safe_dump(as_list(objs), sort_keys=False)


def _parser() -> argparse.ArgumentParser:
    p = settings_parser(
        "pdd operator render",
        "What the operator would write for a file of PDDDeployments, without a cluster: "
        "one kind: List per cluster, the same bytes for the same file.",
    )
    p.add_argument("-f", "--filename", type=Path, required=True, help="YAML with PDDDeployments")
    p.add_argument(
        "--out-dir",
        type=Path,
        help="write one file per cluster here (local.yaml, remote.yaml; with --secrets "
        "secrets-local.yaml, secrets-remote.yaml); default: stdout",
    )
    p.add_argument(
        "--cluster",
        choices=[str(c) for c in Cluster],
        help="the one cluster to write (local: cluster A; remote: cluster B, where "
        "remoteCluster puts MD); needed on stdout when the file spans both",
    )
    p.add_argument(
        "--secrets",
        action="store_true",
        help="write the Secrets the operator would generate once (fresh keys each run: "
        "apply them once, never keep them in Git) instead of the manifests",
    )
    p.add_argument(
        "--shared-token",
        help="with --secrets: the peers' shared token (default: a new random one)",
    )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.shared_token and not args.secrets:
        print("pdd operator render: --shared-token goes with --secrets", file=sys.stderr)
        return 2
    token = (args.shared_token or new_shared_token()) if args.secrets else None
    try:
        rendered = render_file(args.filename.read_text(), token)
    except (OSError, yaml.YAMLError, InvalidSpecError) as exc:
        print(f"pdd operator render: {exc}", file=sys.stderr)
        return 2
    if args.cluster is not None:
        if Cluster(args.cluster) not in rendered:
            print(f"pdd operator render: nothing for cluster {args.cluster} in {args.filename}; "
                  f"it has {', '.join(rendered)}", file=sys.stderr)  # fmt: skip
            return 2
        rendered = {Cluster(args.cluster): rendered[Cluster(args.cluster)]}
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        prefix = "secrets-" if args.secrets else ""
        for cluster, objs in rendered.items():
            (args.out_dir / f"{prefix}{cluster}.yaml").write_text(dump(objs))
        return 0
    if len(rendered) > 1:
        print(
            f"pdd operator render: {args.filename} spans clusters {' and '.join(rendered)}; "
            "standard output takes one: add --cluster NAME (apply each to its own cluster), "
            "or --out-dir DIR for one file per cluster",
            file=sys.stderr,
        )
        return 2
    (objs,) = rendered.values()
    sys.stdout.write(dump(objs))
    return 0
