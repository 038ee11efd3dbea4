"""``pdd operator render``: what the operator would write, without a cluster.

    pdd operator render -f examples/node-pools.yaml --out-dir rendered/

Reads the PDDDeployments of a YAML file, validates each as the operator does and
builds the same plan (``build_plan``), then writes one ``kind: List`` per cluster:
``local.yaml`` for cluster A and, with ``remoteCluster``, ``remote.yaml`` for B
(stdout when no ``--out-dir``). It is how GitOps users review what a spec becomes, and
what the local pod runner (``pdd.local.pods``) starts, so the manifests the operator
renders are the ones that run in our tests.

Without a ``metadata.uid`` in the file (a PDDDeployment not yet in a cluster) the
children carry no owner reference: one naming a made-up uid would make Kubernetes'
garbage collector delete them as orphans. A deployment with ``wan.tls`` on and no
``secretName`` gets a freshly generated CA and certificate in each render (what the
operator does once, on its first reconcile).
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
from pdd.operator.builders.wan_tls import WanTlsMaterial, generates_wan_tls, new_wan_tls
from pdd.operator.naming import KIND, Owner
from pdd.operator.plan import Cluster, build_plan
from pdd.operator.validation import InvalidSpecError, parse_spec


def render_deployment(
    doc: dict[str, Any], token: str, wan_tls: WanTlsMaterial | None = None
) -> dict[Cluster, list[dict[str, Any]]]:
    """One PDDDeployment's children by cluster, in write order; InvalidSpecError if invalid.

    ``wan_tls``: the WAN TLS material to use where the spec asks the operator to generate
    it; None generates a fresh one."""
    meta = doc.get("metadata") or {}
    uid = meta.get("uid") or ""
    owner = Owner(name=meta["name"], namespace=meta.get("namespace") or "default", uid=uid)
    spec = parse_spec(dict(doc.get("spec") or {}), owner.name)
    if generates_wan_tls(spec) and wan_tls is None:
        wan_tls = new_wan_tls(owner.name)
    by_cluster: dict[Cluster, list[dict[str, Any]]] = defaultdict(list)
    for cluster, obj in build_plan(spec, owner, token, wan_tls).children:
        if not uid:
            obj = copy.deepcopy(obj)
            obj["metadata"].pop("ownerReferences", None)
        by_cluster[cluster].append(obj)
    return dict(by_cluster)


def render_file(text: str, token: str) -> dict[Cluster, list[dict[str, Any]]]:
    """Every PDDDeployment of a multi-document YAML text, rendered and merged by cluster."""
    merged: dict[Cluster, list[dict[str, Any]]] = defaultdict(list)
    found = 0
    for doc in yaml.safe_load_all(text):
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            continue
        found += 1
        for cluster, objs in render_deployment(doc, token).items():
            merged[cluster] += objs
    if not found:
        raise InvalidSpecError([f"no {KIND} in the file: nothing to render"])
    return dict(merged)


def as_list(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``kind: List`` that ``kubectl apply -f`` takes as it is."""
    return {"apiVersion": "v1", "kind": "List", "items": objs}


def _parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd operator render", __doc__.splitlines()[0])
    p.add_argument("-f", "--filename", type=Path, required=True, help="YAML with PDDDeployments")
    p.add_argument("--out-dir", type=Path, help="write local.yaml (and remote.yaml) here")
    p.add_argument(
        "--shared-token", help="the peers' shared secret (default: a new random one)"
    )  # fmt: skip
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        rendered = render_file(args.filename.read_text(), args.shared_token or new_shared_token())
    except (OSError, yaml.YAMLError, InvalidSpecError) as exc:
        print(f"pdd operator render: {exc}", file=sys.stderr)
        return 2
    for cluster, objs in rendered.items():
        text = yaml.safe_dump(as_list(objs), sort_keys=False)
        if args.out_dir is None:
            sys.stdout.write(f"# cluster: {cluster}\n---\n{text}")
            continue
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{cluster}.yaml").write_text(text)
    return 0
