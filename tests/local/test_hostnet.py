"""Rendered pods on the host's loopback: ports, the two WAN lines, the flags added.

Pure: the pods come from the operator's own rendering of ``pdd up``'s deployment."""

from __future__ import annotations

import itertools

import pytest

from pdd.local.hostnet import (
    LINE_NAMES,
    HostPod,
    host_argv,
    place,
    plan_lines,
    router_network_args,
    worker_network_args,
)
from pdd.local.manifests import ClusterObjects, HostAddressing, plan_pods
from pdd.local.topology import Counts, StackConfig, mode_objects, stack_deployment
from pdd.operator.render import render_deployment

pytestmark = pytest.mark.unit


TWO_OF_EACH = Counts(prefill=2, relay=2, main=2)
#: Line ports: above the pods' (which count from 30000).
PORTS = itertools.count(40000)


def placed(mode: str) -> list[HostPod]:
    config = StackConfig(mode=mode, counts=TWO_OF_EACH)  # type: ignore[arg-type]
    doc = stack_deployment(config)
    by_cluster, secrets = render_deployment(doc), render_deployment(doc, secrets_token="t0ken")
    clusters = [ClusterObjects(str(c), objs + secrets[c]) for c, objs in by_cluster.items()]
    plans = plan_pods(mode_objects(config.mode, clusters), addressing=HostAddressing())
    return place(plans, router_port=18080, port=itertools.count(30000).__next__)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_every_port_of_every_pod_is_its_own_and_the_router_gets_the_asked_one() -> None:
    pods = placed("pdd")
    ports = [port for pod in pods for port in pod.ports.values()]
    assert len(ports) == len(set(ports))
    [router] = [p for p in pods if p.role == "router"]
    assert router.ports == {"http": 18080}
    assert router.probe_url() == "http://127.0.0.1:18080/ready"
    worker = next(p for p in pods if p.role == "main")
    assert worker.probe_url() == f"http://127.0.0.1:{worker.ports['http']}/ready"


def test_each_line_reaches_the_other_clusters_worker_wan_ports_only() -> None:
    pods = placed("pdd")
    a_to_b, b_to_a = plan_lines(pods, PORTS.__next__)
    assert (a_to_b.name, b_to_a.name) == LINE_NAMES
    by_name = {p.name: p for p in pods}
    assert sorted(a_to_b.routes) == ["pdd-main-0", "pdd-main-1"]
    assert sorted(b_to_a.routes) == [
        "pdd-prefill-0", "pdd-prefill-1", "pdd-relay-0", "pdd-relay-1"
    ]  # fmt: skip
    for line in (a_to_b, b_to_a):
        for name, (_, to) in line.routes.items():
            assert to == by_name[name].address("wan")
    assert plan_lines(placed("samedc"), PORTS.__next__) == []


def test_a_worker_advertises_its_route_on_the_line_the_other_cluster_dials() -> None:
    pods = placed("pdd")
    lines = plan_lines(pods, PORTS.__next__)
    md = next(p for p in pods if p.name == "pdd-main-1")
    relay = next(p for p in pods if p.name == "pdd-relay-0")
    md_args, relay_args = worker_network_args(md, lines), worker_network_args(relay, lines)
    assert flag(md_args, "--advertise-wan") == lines[0].routes[md.name][0]
    assert flag(relay_args, "--advertise-wan") == lines[1].routes[relay.name][0]
    assert flag(md_args, "--advertise-fast") == flag(md_args, "--data") == md.address("kv")
    assert flag(md_args, "--wan") == md.address("wan")
    samedc = placed("samedc")
    local_md = next(p for p in samedc if p.role == "main")
    assert flag(worker_network_args(local_md, []), "--advertise-wan") == local_md.address("wan")


def test_the_router_is_told_each_worker_by_pod_name() -> None:
    pods = placed("naive")
    [router] = [p for p in pods if p.role == "router"]
    workers = [p for p in pods if p.role != "router"]
    args = router_network_args(router, workers)
    assert flag(args, "--port") == "18080"
    assert f"pdd-prefill-1={workers[1].http_url}" in args
    assert "--relay" not in args and args.count("--main") == 2


def test_arguments_into_a_mount_point_at_the_host_folder_standing_for_it() -> None:
    md = next(p for p in placed("pdd") if p.role == "main")
    argv = host_argv(md, {"/etc/pdd": "/tmp/x/etc_pdd"})
    assert argv[-4:] == ["--role", "main", "--config", "/tmp/x/etc_pdd/config.json"]
    assert host_argv(md, {"/etc/pd": "/elsewhere"})[-1] == "/etc/pdd/config.json"
