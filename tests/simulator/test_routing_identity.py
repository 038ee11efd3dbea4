"""The simulator decides with the router's own code, not a copy of it."""

from __future__ import annotations

import pytest

import pdd.common.cost_model as cost_model
import pdd.common.handoff as handoff
import pdd.router.instance_choice as instance_choice
import pdd.router.policy as router_policy
import pdd.simulator.cluster as cluster
import pdd.simulator.decode as decode
import pdd.simulator.lifecycle as lifecycle
from pdd.worker.transport.payloads import encode_token_ids

pytestmark = pytest.mark.unit


def test_pipeline_policy_and_instance_choice_are_the_routers_modules() -> None:
    assert cluster.decide is router_policy.decide
    assert cluster.PolicyConfig is router_policy.PolicyConfig
    assert lifecycle.Pipeline is router_policy.Pipeline
    assert router_policy.choose_main_decode is instance_choice.choose_main_decode
    assert decode.InstanceLoad is instance_choice.InstanceLoad
    assert cluster.LinkState is cost_model.LinkState
    assert router_policy.wan_transfer_seconds is cost_model.wan_transfer_seconds


def test_handoff_mode_rule_is_the_workers() -> None:
    from pdd.worker.roles import relay

    assert lifecycle.choose_handoff_mode is handoff.choose_handoff_mode
    assert relay.choose_handoff_mode is handoff.choose_handoff_mode


def test_handoff_payload_size_matches_the_worker_wire_format() -> None:
    for n in (0, 1, 100, 4096):
        assert lifecycle.handoff_bytes(n) == len(encode_token_ids(7, list(range(n))))


def test_the_link_view_is_the_routers_estimator() -> None:
    import pdd.common.link_estimator as link_estimator
    import pdd.router.dispatcher as dispatcher

    assert cluster.LinkEstimator is link_estimator.LinkEstimator
    assert dispatcher.LinkEstimator is link_estimator.LinkEstimator
