"""Calibration: the fit recovers known knobs, says when it cannot, and the CLI round-trips."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pdd.cli import main as pdd_main
from pdd.simulator.calibrate_cli import main
from pdd.simulator.calibration import (
    CalibrationError,
    ProfiledModel,
    StepProfile,
    StepSample,
    fit_efficiency,
    load_profile,
)
from pdd.simulator.hardware import Efficiency, GpuType, InstanceShape, ModelSpec
from pdd.simulator.scenario import GpuSpec

pytestmark = pytest.mark.unit

REPO = Path(__file__).parents[2]
H100 = GpuType(
    "h100",
    peak_tflops=989,
    memory_gb=80,
    memory_bandwidth_tbps=3.35,
    interconnect_gbps=450,
    price_per_hour=2.5,
)
LLAMA_8B = ModelSpec(
    "llama-8b",
    active_params_b=7.5,
    weight_gb=16.06,
    kv_bytes_per_token=131072,
    attention_flops_per_pair=4 * 32 * 32 * 128,
    num_layers=32,
    hidden_size=4096,
)
TRUTH = Efficiency(mfu=0.42, mbu=0.71, overhead_s=0.0035)


def shapes(kinds=("prefill", "decode", "extend"), prefill_new=(16, 64, 256, 1024, 4096)):
    """(kind, new, kv_read, pairs) on a grid like bench/step_profile.py's."""
    out = [("prefill", n, c + n, n * c + n * n / 2) for n in prefill_new for c in (0, 1024, 4096)]
    out += [("decode", b, b * c, b * c) for b in (1, 4, 16, 64) for c in (128, 1024, 4096)]
    out += [("extend", m, c + m, m * c + m * m / 2) for m in (16, 64, 256) for c in (1024, 4096)]
    return [s for s in out if s[0] in kinds]


def samples_from(
    truth: Efficiency, noise: float = 0.0, gpu: GpuType = H100, gpus: int = 1, **kw
) -> list[StepSample]:
    """Steps timed by the step model itself (times (1 +- noise), seeded)."""
    shape = InstanceShape(replace(gpu, efficiency=truth), gpus, LLAMA_8B)
    rng = random.Random(7)
    return [
        StepSample(
            kind=k,
            new_tokens=n,
            kv_read_tokens=kv,
            attention_pairs=p,
            seconds=shape.step_seconds(n, kv, p) * (1 + rng.uniform(-noise, noise)),
        )
        for k, n, kv, p in shapes(**kw)
    ]


def assert_close(fitted: Efficiency, truth: Efficiency, rel: float) -> None:
    for knob in ("mfu", "mbu", "overhead_s"):
        assert getattr(fitted, knob) == pytest.approx(getattr(truth, knob), rel=rel), knob


# --- the fit ------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpus", [1, 4])
def test_fit_recovers_the_knobs_that_generated_the_samples(gpus):
    result = fit_efficiency(LLAMA_8B, H100, gpus, samples_from(TRUTH, gpus=gpus))
    assert_close(result.efficiency, TRUTH, rel=0.02)
    assert {k.kind for k in result.per_kind} == {"prefill", "decode", "extend"}
    assert all(k.median_error < 0.01 for k in result.per_kind)
    assert result.warnings == ()


def test_fit_tolerates_five_percent_noise():
    result = fit_efficiency(LLAMA_8B, H100, 1, samples_from(TRUTH, noise=0.05))
    assert_close(result.efficiency, TRUTH, rel=0.10)
    assert 0.005 < result.rms_error < 0.05


def test_prefill_only_profile_warns_that_mbu_is_unidentifiable_and_keeps_the_prior():
    # long prefills only: compute bounds every step, so no sample depends on mbu
    samples = samples_from(TRUTH, kinds=("prefill",), prefill_new=(1024, 4096))
    result = fit_efficiency(LLAMA_8B, H100, 1, samples)
    assert result.efficiency.mfu == pytest.approx(TRUTH.mfu, rel=0.02)
    assert result.efficiency.mbu == pytest.approx(H100.efficiency.mbu)  # the prior
    assert any("mbu is unidentifiable" in w for w in result.warnings), result.warnings
    assert not any("mfu" in w for w in result.warnings), result.warnings


def test_decode_only_profile_warns_that_mfu_is_unidentifiable():
    result = fit_efficiency(LLAMA_8B, H100, 1, samples_from(TRUTH, kinds=("decode",)))
    assert result.efficiency.mbu == pytest.approx(TRUTH.mbu, rel=0.02)
    assert any("no prefill samples: mfu is unidentifiable" in w for w in result.warnings)


def test_a_declared_peak_below_the_device_pins_mfu_at_one_and_says_so():
    fast = replace(H100, peak_tflops=2 * H100.peak_tflops)  # the device really reaches 0.84 x this
    samples = samples_from(replace(TRUTH, mfu=0.84), gpu=fast)
    result = fit_efficiency(LLAMA_8B, H100, 1, samples)
    assert result.efficiency.mfu == 1.0
    assert any("mfu hit the bound 1.0" in w and "peak_tflops" in w for w in result.warnings)


def test_fit_without_samples_is_a_calibration_error():
    with pytest.raises(CalibrationError, match="no samples"):
        fit_efficiency(LLAMA_8B, H100, 1, [])


# --- the profile --------------------------------------------------------------------------------
def write_profile(path: Path, samples: list[StepSample]) -> Path:
    model = ProfiledModel(**{f: getattr(LLAMA_8B, f) for f in ProfiledModel.model_fields})
    profile = StepProfile(device="test", dtype="bfloat16", model=model, samples=samples)
    path.write_text(profile.model_dump_json())
    return path


def test_profile_round_trips_and_converts_to_the_model_spec(tmp_path):
    samples = samples_from(TRUTH)
    profile = load_profile(write_profile(tmp_path / "p.json", samples))
    assert profile.samples == samples
    assert profile.model.to_spec() == LLAMA_8B


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: "{not json", "Invalid JSON"),
        (lambda d: d["samples"][0].pop("seconds") and d, "samples.0.seconds: Field required"),
        (lambda d: d["model"].pop("num_layers") and d, "model.num_layers: Field required"),
        (lambda d: d["samples"][1].update(seconds=-1.0) or d, "samples.1.seconds"),
        (lambda d: d["samples"][0].update(kind="warmup") or d, "samples.0.kind"),
        (lambda d: d.update(samples=[]) or d, "samples"),
    ],
)
def test_malformed_profile_is_a_calibration_error_naming_the_field(tmp_path, mutate, message):
    path = write_profile(tmp_path / "p.json", samples_from(TRUTH))
    data = mutate(json.loads(path.read_text()))
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(CalibrationError, match="is not a step profile") as err:
        load_profile(path)
    assert message in str(err.value)


def test_missing_profile_is_a_calibration_error(tmp_path):
    with pytest.raises(CalibrationError, match="cannot read profile"):
        load_profile(tmp_path / "absent.json")


# --- the CLI ------------------------------------------------------------------------------------
def cli_args(profile: Path, *extra: str) -> list[str]:
    return [
        str(profile),
        "--gpu-name",
        "h100",
        "--peak-tflops",
        "989",
        "--memory-gb",
        "80",
        "--bandwidth-tbps",
        "3.35",
        "--interconnect-gbps",
        "450",
        "--price-per-hour",
        "2.5",
        *extra,
    ]


def test_cli_writes_yaml_that_loads_back_into_the_fitted_gpu_type(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json", samples_from(TRUTH))
    out = tmp_path / "gpu.yaml"
    assert pdd_main(["calibrate", *cli_args(profile, "--out", str(out))]) == 0
    table = capsys.readouterr().out
    assert "prefill" in table and "decode" in table and "extend" in table
    data = yaml.safe_load(out.read_text())
    assert list(data) == ["h100"]  # one entry of a scenario's gpus: mapping
    gpu = GpuSpec.model_validate(data["h100"]).build("h100")
    assert replace(gpu, efficiency=H100.efficiency) == H100
    assert_close(gpu.efficiency, TRUTH, rel=0.02)


def test_cli_prints_the_yaml_without_out(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json", samples_from(TRUTH))
    assert main(cli_args(profile)) == 0
    yaml_text = capsys.readouterr().out.split("h100:", 1)[1]
    assert "efficiency:" in yaml_text and "overhead_s:" in yaml_text


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda p: cli_args(p.with_name("absent.json")), "cannot read profile"),
        (lambda p: cli_args(p, "--gpus", "0"), "gpus per instance must be positive"),
        (lambda p: [*cli_args(p)[:4], "-1", *cli_args(p)[5:]], "peak_tflops must be positive"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, make_args, message):
    profile = write_profile(tmp_path / "p.json", samples_from(TRUTH))
    assert main(make_args(profile)) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdd calibrate: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_missing_option_is_a_usage_error(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json", samples_from(TRUTH))
    assert main([str(profile), "--gpu-name", "h100"]) == 2
    assert "required" in capsys.readouterr().err
