"""Calibration on a real step profile: the tiny model measured on this CPU, then fitted."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.simulator.calibration import fit_efficiency, load_profile
from pdd.simulator.hardware import GpuType

#: A profiling run of the real engine in a child process: tens of seconds.
pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]


def test_profile_of_the_tiny_model_on_cpu_validates_and_fits(tmp_path):
    out = tmp_path / "tiny.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "step_profile.py"),
        "--grid",
        "small",
        "--repeats",
        "2",
        "--threads",
        "2",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=240)
    profile = load_profile(out)
    assert profile.model.name == "tiny" and profile.dtype == "float32"
    assert {s.kind for s in profile.samples} == {"prefill", "decode", "extend"}
    for s in profile.samples:
        assert s.seconds > 0
        if s.kind == "decode":  # b sequences of at least the 128-token prompt each
            assert s.kv_read_tokens == s.attention_pairs >= 128 * s.new_tokens
        else:  # the prefix cache held exactly the asked-for c tokens
            cached = s.kv_read_tokens - s.new_tokens
            assert cached in (0, 256)
            assert s.attention_pairs == s.new_tokens * cached + s.new_tokens**2 / 2
    cpu = GpuType(
        "cpu",
        peak_tflops=0.166,
        memory_gb=16,
        memory_bandwidth_tbps=0.05,
        interconnect_gbps=10,
        price_per_hour=0.1,
    )
    result = fit_efficiency(profile.model.to_spec(), cpu, 1, profile.samples)
    assert math.isfinite(result.rms_error)
    assert 0 < result.efficiency.mfu <= 1 and 0 < result.efficiency.mbu <= 1
    assert 0 <= result.efficiency.overhead_s < max(s.seconds for s in profile.samples)
