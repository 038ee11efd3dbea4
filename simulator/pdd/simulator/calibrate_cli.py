"""``pdd calibrate PROFILE.json --gpu-name ... [--out gpu.yaml]``: fit a step profile and
write the GPU type, with its fitted efficiency, as an entry of a scenario's ``gpus:``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from pdd.common.settings import parser as settings_parser
from pdd.simulator.calibration import (
    CalibrationError,
    FitResult,
    StepProfile,
    fit_efficiency,
    load_profile,
)
from pdd.simulator.hardware import Efficiency, GpuType, HardwareError
from pdd.simulator.scenario import EfficiencySpec, GpuSpec


def main(argv: Sequence[str] | None = None) -> int:
    """``pdd calibrate PROFILE.json --gpu-name ... [--out gpu.yaml]``; 2 on bad input."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed usage and the error (or --help)
        return int(e.code or 0)
    try:
        profile = load_profile(args.profile)
        gpu = _gpu(args)
        result = fit_efficiency(profile.model.to_spec(), gpu, args.gpus, profile.samples)
    except (CalibrationError, HardwareError) as e:
        print(f"pdd calibrate: {e}", file=sys.stderr)
        return 2
    print(_report(profile, result))
    text = yaml.safe_dump(gpu_yaml(gpu, result.efficiency), sort_keys=False)
    if args.out is None:
        print(text, end="")
        return 0
    try:
        args.out.write_text(text)
    except OSError as e:
        print(f"pdd calibrate: cannot write {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


def gpu_yaml(gpu: GpuType, eff: Efficiency) -> dict:
    """The GPU type as one entry of a scenario's ``gpus:`` mapping, ``{name: {...}}``,
    written through the scenario schema (4 significant digits per knob)."""
    spec = GpuSpec(
        peak_tflops=gpu.peak_tflops,
        memory_gb=gpu.memory_gb,
        memory_bandwidth_tbps=gpu.memory_bandwidth_tbps,
        interconnect_gbps=gpu.interconnect_gbps,
        price_per_hour=gpu.price_per_hour,
        efficiency=EfficiencySpec(
            mfu=float(f"{eff.mfu:.4g}"),
            mbu=float(f"{eff.mbu:.4g}"),
            overhead_s=float(f"{eff.overhead_s:.4g}"),
        ),
    )
    return {gpu.name: spec.model_dump()}


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd calibrate", "fit mfu, mbu and overhead_s to a step profile")
    p.add_argument("profile", type=Path, help="JSON written by bench/step_profile.py")
    p.add_argument("--gpu-name", required=True, help="name the fitted GPU spec gets")
    p.add_argument("--peak-tflops", type=float, required=True, help="dense, in the model's dtype")
    p.add_argument("--memory-gb", type=float, required=True, help="device memory, GB")
    p.add_argument("--bandwidth-tbps", type=float, required=True, help="memory bandwidth, TB/s")
    p.add_argument("--interconnect-gbps", type=float, required=True, help="GB/s between chips")
    p.add_argument(
        "--price-per-hour", type=float, required=True, help="cost per GPU hour (cost model)"
    )
    p.add_argument("--gpus", type=int, default=1, help="chips the profile ran on (tensor parallel)")
    p.add_argument("--out", type=Path, default=None, help="write the YAML here (else stdout)")
    return p


def _gpu(args: argparse.Namespace) -> GpuType:
    return GpuType(
        name=args.gpu_name,
        peak_tflops=args.peak_tflops,
        memory_gb=args.memory_gb,
        memory_bandwidth_tbps=args.bandwidth_tbps,
        interconnect_gbps=args.interconnect_gbps,
        price_per_hour=args.price_per_hour,
    )


def _report(profile: StepProfile, result: FitResult) -> str:
    e = result.efficiency
    lines = [
        f"profile: {profile.model.name}, {profile.dtype} on {profile.device}, "
        f"{len(profile.samples)} samples",
        f"fitted:  mfu={e.mfu:.4g}  mbu={e.mbu:.4g}  overhead_s={e.overhead_s:.4g}  "
        f"(rms relative error {result.rms_error:.1%})",
        f"{'kind':<8} {'samples':>7} {'median error':>13}",
    ]
    lines += [f"{k.kind:<8} {k.samples:>7} {k.median_error:>13.1%}" for k in result.per_kind]
    lines += [f"warning: {w}" for w in result.warnings]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
