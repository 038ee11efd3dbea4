"""The live planner's model of a deployment (what the operator runs, without the scenario
loader) is the one ``pdd plan`` and the simulated day size with."""

from __future__ import annotations

import pytest
import yaml

from pdd.simulator.planner.deployment import deployment_model
from pdd.simulator.planner.load import LoadError
from pdd.simulator.planner.model_file import load_model, parse_model, scenario_path
from pdd.simulator.scenario import load_scenario

pytestmark = pytest.mark.unit


def test_the_published_pdd_system_reads_as_the_scenario_loader_reads_it() -> None:
    scenario, _ = load_scenario("published")
    line, rtt = scenario.wan.gbps, scenario.wan.rtt_ms / 1000
    assert load_model("published", line, rtt) == deployment_model(scenario, "pdd")


def test_the_line_is_the_deployments_not_the_files() -> None:
    model = load_model("published", 25.0, 0.05)
    assert (model.line_gbps, model.rtt_s) == (25.0, 0.05)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(extends="published"), "without 'extends'"),
        (lambda d: d["systems"]["pdd"]["main"].update(gpu="C"), "not one of"),
        (lambda d: d["systems"].pop("pdd"), "no 'pdd' mapping"),
        (lambda d: d["gpus"]["A"].update(memory_gb=-1), "memory_gb must be positive"),
    ],
)
def test_a_file_the_planner_cannot_use_says_why(edit, message: str) -> None:
    doc = yaml.safe_load(scenario_path("published").read_text())
    edit(doc)
    with pytest.raises(LoadError, match=message):
        parse_model(doc, "pdd", 100.0, 0.03)


def test_a_missing_file_is_a_load_error() -> None:
    with pytest.raises(LoadError, match="no-such"):
        load_model("/no-such/scenario.yaml", 100.0, 0.03)
