"""The chart's ``tracing`` values reach every PDDDeployment the operator serves (issue 58).

Rendered with real Helm: the values become ``pdd operator``'s default-tracing flags, which
the operator turns into the spec.observability.tracing of a PDDDeployment that sets none
(its own wins), and so into every pod's OTEL_* environment. Bad values fail the install
naming the field.
"""

from __future__ import annotations

import copy
from typing import Any

import helm_python
import pytest
import yaml

from pdd.operator.default_tracing import default_tracing, with_default_tracing
from pdd.operator.main import build_parser
from pdd.operator.naming import Owner
from pdd.operator.plan import build_plan
from pdd.operator.validation import parse_spec

pytestmark = pytest.mark.unit

ENDPOINT = "http://otel-collector.monitoring:4318"
OWNER = Owner(name="qwen", namespace="serving", uid="0b9e7c1e-0000-4000-8000-000000000001")


def operator_flags(chart, find_object, values: dict[str, Any]) -> Any:
    deployment = find_object(chart.objects(values), "Deployment", "pdd-operator")
    parser = build_parser()
    args = parser.parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    return default_tracing(parser, args)


def example_spec(chart) -> dict[str, Any]:
    docs = yaml.safe_load_all((chart.examples / "node-pools.yaml").read_text())
    return next(d for d in docs if d and d.get("kind") == "PDDDeployment")["spec"]


def router_env(raw_spec: dict[str, Any]) -> dict[str, str]:
    spec = parse_spec(raw_spec, OWNER.name)
    for _, obj in build_plan(spec, OWNER, "token").children:
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "qwen-router":
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            return {e["name"]: e.get("value") for e in container["env"]}
    raise AssertionError("no router Deployment")


def test_values_become_every_pods_tracing(chart, find_object) -> None:
    default = operator_flags(chart, find_object,
                             {"tracing": {"endpoint": ENDPOINT, "sampleRatio": 0.1}})  # fmt: skip
    assert default is not None
    assert (default.endpoint, default.sample_ratio) == (ENDPOINT, 0.1)
    env = router_env(with_default_tracing(example_spec(chart), default))
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == ENDPOINT
    assert float(env["OTEL_TRACES_SAMPLER_ARG"]) == 0.1


def test_a_deployments_own_tracing_wins(chart, find_object) -> None:
    default = operator_flags(chart, find_object, {"tracing": {"endpoint": ENDPOINT}})
    own = copy.deepcopy(example_spec(chart))
    own["observability"] = {"tracing": {"endpoint": "https://tempo.b:4318", "sampleRatio": 0.5}}
    env = router_env(with_default_tracing(own, default))
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "https://tempo.b:4318"
    assert float(env["OTEL_TRACES_SAMPLER_ARG"]) == 0.5


def test_without_values_no_default_and_no_otel_env(chart, find_object) -> None:
    assert operator_flags(chart, find_object, {}) is None
    env = router_env(with_default_tracing(example_spec(chart), None))
    assert not [name for name in env if name.startswith("OTEL_")]


@pytest.mark.parametrize(
    "tracing",
    [{"endpoint": "otel-collector:4318"}, {"endpoint": ENDPOINT, "sampleRatio": 2}],
    ids=["no-scheme", "ratio-above-1"],
)
def test_schema_rejects_bad_tracing_values(chart, tracing: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.render({"tracing": tracing})
    assert "/tracing/" in str(err.value)


def test_operator_refuses_bad_flags_at_start() -> None:
    parser = build_parser()
    for argv in (["--tracing-endpoint", "collector:4318"],
                 ["--tracing-endpoint", ENDPOINT, "--tracing-sample-ratio", "1.5"]):  # fmt: skip
        with pytest.raises(SystemExit):
            default_tracing(parser, parser.parse_args(argv))
