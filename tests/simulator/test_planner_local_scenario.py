"""The committed scenario of the local stack (docs/benchmarks/planner/local-tiny-cpu.yaml):
``pdd up --autoscale --autoscale-scenario FILE`` sizes the tiny CPU workers with it, so
it must be what ``pdd calibrate`` fits to the committed profile, read alike by the
planner and the scenario loader, and price the tiny model's own KV on the line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdd.simulator.calibration import fit_efficiency, load_profile
from pdd.simulator.hardware import GpuType
from pdd.simulator.planner.deployment import deployment_model
from pdd.simulator.planner.load import ObservedLoad
from pdd.simulator.planner.model_file import load_model
from pdd.simulator.planner.planner import line_is_bottleneck
from pdd.simulator.scenario import load_scenario

pytestmark = pytest.mark.unit

PLANNER = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "planner"
SCENARIO = PLANNER / "local-tiny-cpu.yaml"
PROFILE = PLANNER / "tiny-cpu-1thread-profile.json"
#: pdd up's default line (pdd.local.topology.DEFAULT_LINK): 50 Mbit/s, 30 ms.
LINE_GBPS, RTT_S = 0.05, 0.03


def test_its_knobs_are_what_calibrate_fits_to_the_committed_profile() -> None:
    """The file's provenance holds: fitting the profile, with the peaks the file declares,
    gives the efficiency both of its pools' "GPUs" carry (to calibrate's 4 digits)."""
    gpus = yaml.safe_load(SCENARIO.read_text())["gpus"]
    profile = load_profile(PROFILE)
    declared = {k: v for k, v in gpus["A"].items() if k != "efficiency"}
    fit = fit_efficiency(
        profile.model.to_spec(), GpuType(name="A", **declared), 1, profile.samples
    ).efficiency
    fitted = {k: float(f"{getattr(fit, k):.4g}") for k in ("mfu", "mbu", "overhead_s")}
    assert gpus["A"]["efficiency"] == fitted and gpus["B"] == gpus["A"]
    assert yaml.safe_load(SCENARIO.read_text())["model"] == profile.model.model_dump()


def test_the_planner_reads_it_as_the_scenario_loader_does() -> None:
    scenario, _ = load_scenario(str(SCENARIO))
    assert load_model(str(SCENARIO), LINE_GBPS, RTT_S) == deployment_model(scenario, "pdd")


def test_a_bench_interval_of_the_tiny_model_is_not_line_bound_on_it() -> None:
    """An interval like run 3's 4x step (docs/planner.md): 4.7 req/s of 220-token prompts,
    no hit, the line read at 45 Mbit/s, needs 17 Mbit/s of tiny's KV; the published model
    prices the same tokens at its 50 KB each, 25 times more, and so called the line the
    bottleneck (which blocks the correction from measured TTFT)."""
    load = ObservedLoad(4.7, 220.0, 30.0, p_hit=0.0, md_hit=0.0, wan_gbps=0.045)
    local = load_model(str(SCENARIO), LINE_GBPS, RTT_S)
    assert not line_is_bottleneck(local, load)
    assert line_is_bottleneck(load_model("published", LINE_GBPS, RTT_S), load)
