"""A route's plan carries the router's predicted MD hit where P ships KV to MD."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdd.common.vocabulary import Pipeline, Role
from pdd.common.wire import Endpoint, SamplingSpec
from pdd.router.config import RouterConfig, WorkerRef
from pdd.router.route import Route, md_computing_key, md_computing_tokens

pytestmark = pytest.mark.unit

CONFIG = RouterConfig(model="tiny", workers=(WorkerRef(Role.MONO, "http://m", "m"),), secret="s")


def endpoint(name: str) -> Endpoint:
    return Endpoint(instance_id=name, http_url=f"http://{name}", fast_addr="h:1", wan_addr="h:2")


def test_p_md_plans_tell_p_where_mds_hit_is_predicted_to_end() -> None:
    route = Route(
        Pipeline.P_MD, "r", "c", endpoint("p"), None, endpoint("md"), p_hit_tokens=16,
        md_hit_tokens=48,
    )  # fmt: skip
    plan = route.plan("req", list(range(64)), SamplingSpec(), CONFIG)
    assert plan.main_hit_tokens == 48


def test_routes_that_ship_no_kv_to_md_predict_nothing() -> None:
    relay_only = Route(Pipeline.P_RLD, "r", "c", endpoint("p"), endpoint("rld"), None)
    mono = Route(Pipeline.MONO, "r", "c", None, None, endpoint("m"), md_hit_tokens=8)
    for route in (relay_only, mono):
        assert route.plan("req", [1, 2, 3], SamplingSpec(), CONFIG).main_hit_tokens is None


def test_a_route_where_md_computes_its_miss_puts_nothing_on_the_line() -> None:
    """The plan tells P and MD; the route counts no transfer on the WAN line (its backlog,
    the link estimator's samples): only the first token crosses."""
    route = Route(
        Pipeline.P_MD, "r", "c", endpoint("p"), None, endpoint("md"), md_hit_tokens=48,
        kv_codec="none", kv_bytes_per_token=0, md_computes_miss=True,
    )  # fmt: skip
    plan = route.plan("req", list(range(64)), SamplingSpec(), CONFIG)
    assert plan.md_computes_miss and route.ships_kv and not route.loads_line
    assert route.lease_keys == ["p", "md"] and route.lease_amounts == {}  # no tokens named
    counted = replace(route, md_compute_tokens=16)
    assert counted.lease_keys == ["p", "md", md_computing_key("md")]
    assert counted.lease_amounts == {md_computing_key("md"): 16}
    assert md_computing_tokens({md_computing_key("md"): 16, "md": 1}) == {"md": 16}
    crossing = Route(Pipeline.P_MD, "r", "c", endpoint("p"), None, endpoint("md"), kv_bytes=2048)
    assert not crossing.plan("req", list(range(64)), SamplingSpec(), CONFIG).md_computes_miss
    assert crossing.loads_line and len(crossing.lease_keys) == 4
