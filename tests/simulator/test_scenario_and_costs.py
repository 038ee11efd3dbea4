"""Scenario files: validation with the fix in the message; the published cost arithmetic."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pdd.local.traces import load_trace
from pdd.local.traces.claude_code import session_files
from pdd.simulator.costs import cost_at_premium, gpu_counts, system_cost_per_hour
from pdd.simulator.scenario import ScenarioError, load_scenario, shipped_scenarios

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def published():
    scenario, _ = load_scenario("published")
    return scenario


def test_every_shipped_scenario_loads() -> None:
    names = shipped_scenarios()
    assert {"published", "collapse", "bathtub"} <= set(names)
    for name in names:
        scenario, base = load_scenario(name)
        assert scenario.name == name and base.is_dir()


def test_the_published_hardware_is_the_published_setup(published) -> None:
    assert gpu_counts(published.systems["baseline"]) == {"A": 88}
    assert gpu_counts(published.systems["pdd"]) == {"A": 43, "B": 32}
    assert published.systems["pdd"].uses_wan and not published.systems["baseline"].uses_wan


@pytest.mark.parametrize(("premium", "saving"), [(0.20, 0.07136), (0.25, 0.05318), (0.30, 0.035)])
def test_pdd_hardware_is_3_5_to_7_1_percent_cheaper_across_the_premium_range(
    published, premium: float, saving: float
) -> None:
    """Exact arithmetic: 88 A = 176 $/h; 43 A + 32 B at (1 + premium) x A + the line."""
    point = cost_at_premium(
        published, published.systems["baseline"], published.systems["pdd"], premium
    )
    assert point.baseline_cost == pytest.approx(88 * 2.00)
    assert point.candidate_cost == pytest.approx(43 * 2.00 + 32 * 2.00 * (1 + premium) + 0.64)
    assert point.saving == pytest.approx(saving, abs=1e-5)
    assert 0.035 - 1e-12 <= point.saving <= 0.0715  # the published 3.5-7.1%, to one decimal


def test_cost_counts_gpus_per_instance_and_the_line_only_where_used(published) -> None:
    spec = published.systems["pdd"]
    doubled = spec.model_copy(
        update={"main": spec.main.model_copy(update={"instances": 16, "gpus_per_instance": 2})}
    )
    assert system_cost_per_hour(published, doubled) == system_cost_per_hour(published, spec)
    assert system_cost_per_hour(published, published.systems["baseline"]) == 176.0


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def published_doc() -> dict:
    scenario, _ = load_scenario("published")
    return scenario.model_dump(mode="json")


def test_an_unknown_gpu_is_named_with_the_choices(tmp_path: Path) -> None:
    doc = published_doc()
    doc["systems"]["pdd"]["main"]["gpu"] = "C"
    with pytest.raises(ScenarioError, match=r"systems.pdd.main.gpu 'C' is not one of the gpus"):
        load_scenario(str(write(tmp_path, doc)))


def test_a_pdd_system_without_relays_is_refused(tmp_path: Path) -> None:
    doc = published_doc()
    doc["systems"]["pdd"]["relay"] = None
    with pytest.raises(ScenarioError, match=r"pdd system has pools \['main', 'relay'\]"):
        load_scenario(str(write(tmp_path, doc)))


def test_misspelt_fields_and_bad_values_name_their_path(tmp_path: Path) -> None:
    doc = published_doc()
    doc["wan"]["gbsp"] = 10
    doc["slo"]["ttft_s"] = -1
    with pytest.raises(ScenarioError) as err:
        load_scenario(str(write(tmp_path, doc)))
    assert "wan.gbsp" in str(err.value) and "slo.ttft_s" in str(err.value)


def test_an_unknown_name_lists_the_shipped_scenarios() -> None:
    with pytest.raises(ScenarioError, match="shipped ones are"):
        load_scenario("no-such-scenario")


def test_a_premium_table_without_its_gpus_and_systems_is_refused(tmp_path: Path) -> None:
    doc = published_doc()
    doc["gpus"]["C"] = doc["gpus"].pop("B")
    for spec in doc["systems"].values():
        for pool in spec.values():
            if isinstance(pool, dict) and pool.get("gpu") == "B":
                pool["gpu"] = "C"
    with pytest.raises(ScenarioError, match=r"premium_range needs gpus.B; or drop it"):
        load_scenario(str(write(tmp_path, doc)))


def test_router_knobs_default_to_the_routers_own_policy_defaults() -> None:
    from pdd.router.policy import PolicyConfig
    from pdd.simulator.scenario import RouterSpec

    spec = RouterSpec()
    for knob in ("ttft_budget_s", "anomalous_min_input_tokens", "relay_only_max_share"):
        assert getattr(spec, knob) == getattr(PolicyConfig(kv_bytes_per_token=1), knob)


#: The trace sample committed with the repository (bench/traces/README.md).
SAMPLE = Path(__file__).resolve().parents[2] / "bench" / "traces"


@pytest.mark.parametrize(
    ("name", "path"),
    [("claude-code", "claude-code"), ("mooncake", "mooncake/conversation_trace.jsonl")],
)
def test_shipped_trace_scenarios_read_the_bundled_sample_unless_told(
    name: str, path: str, tmp_path: Path
) -> None:
    scenario, base = load_scenario(name)
    assert base == SAMPLE and scenario.workload.path == Path(path)
    assert len(scenario.workload.build(base)) == len(load_trace(SAMPLE / path))
    # --traces DIR: the same relative path under another folder (e.g. the full traces).
    other = tmp_path / "full"
    (other / path).parent.mkdir(parents=True, exist_ok=True)
    if name == "claude-code":
        (other / path).mkdir()
        first = session_files(SAMPLE / path)[0]
        shutil.copy(first, other / path / first.name)
    else:
        lines = (SAMPLE / path).read_text().splitlines(keepends=True)
        (other / path).write_text("".join(lines[:7]))
    scenario, base = load_scenario(name, other)
    assert base == other
    cut = len(load_trace(other / path))
    assert len(scenario.workload.build(base)) == cut < len(load_trace(SAMPLE / path))


def test_a_scenario_files_trace_paths_resolve_against_its_folder(tmp_path: Path) -> None:
    doc = {"extends": "mooncake", "workload": {"kind": "trace", "path": "t.jsonl"}}
    (tmp_path / "t.jsonl").write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 9, "hash_ids": [0, 1]}\n'
    )
    scenario, base = load_scenario(str(write(tmp_path, doc)))
    assert base == tmp_path and len(scenario.workload.build(base)) == 1
    elsewhere = tmp_path / "elsewhere"
    assert load_scenario(str(write(tmp_path, doc)), elsewhere)[1] == elsewhere
