"""The engine's compiled CPU kernels (``cpu_kernels.cpp``): which variant this CPU runs,
building it once, and the kernels a model uses.

Attention over the paged cache (every query token of a step: decode and prefill
alike), residual add + RMSNorm, SiLU-and-mul, and RoPE with the cache write: what a
step spends most outside its matmuls when each is a chain of eager torch ops (the
.cpp says why each exists).

**Variants.** One source, compiled for one vector width per variant: ``avx512_bf16``
(AVX-512 F/BW/VL/DQ and AVX512-BF16's bf16 dot products), ``avx512``, and ``avx2``
(AVX2 + FMA + F16C: AMD EPYC before Zen 4 and many cloud instance types). The CPU's
flags (``/proc/cpuinfo``) choose the widest it can run; none elsewhere. Each variant is
compiled for exactly those instruction sets (not ``-march=native``), so a build serves
every CPU that has them, a worker image can carry it, and a forced narrower variant
(``PDD_CPU_KERNELS=avx2`` on an AVX-512 machine: tests and benchmarks) is the same code
an AVX2 machine runs.

**Built once per machine, never blocking** (``cpu_kernels_build``): ``scripts/setup.sh``
calls ``main``, otherwise the first process that needs the kernels builds them, into a
cache keyed by the source, torch's and Python's versions, the compiler and the
variant's flags. A failed build is recorded there, so no later process tries again; a
builder that dies leaves nothing that blocks; the compiler's output goes to a log file
in the cache, never to the process's own log.

Where the kernels do not apply (an accelerator, a dtype other than bf16/fp32) or are
not available (no variant for this CPU, no compiler, a failed build), the model runs
torch's own ops (attention through SDPA), so the kernels are a speed-up, never a
requirement. ``PDD_CPU_KERNELS`` = ``auto`` (the default) | ``off`` (torch's ops on
purpose: to compare, or to rule the kernels out) | a variant's name.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import logging
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from pdd.worker.model.cpu_kernels_build import Outcome, Target, build_once, record_failure

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, inlined from its header;
# without the flag the pragma is ignored and every kernel runs on one thread.
# -ffp-contract=off: a product followed by a sum stays two roundings, as in the eager
# ops the row-wise kernels reproduce (GCC would otherwise fuse them into one FMA).
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-std=c++20")
HEAD_DIMS = frozenset({16, 32, 64, 80, 96, 128, 256})  # attention's instantiations
DTYPES = frozenset({torch.bfloat16, torch.float32})
ENV_CHOICE = "PDD_CPU_KERNELS"  # "auto" (default; "on" too) | "off" | a variant's name
ENV_BUILD_DIR = "PDD_EXTENSIONS_DIR"
ENV_WAIT = "PDD_CPU_KERNELS_WAIT_S"  # how long to wait for another process's build
DEFAULT_WAIT_S = 300.0  # a build takes about 40 s on an idle 2-core machine


@dataclass(frozen=True)
class Variant:
    """One compilation of the kernels: the CPU flags it needs and the compiler's."""

    name: str
    needs: frozenset[str]  # /proc/cpuinfo flags
    cflags: tuple[str, ...]
    about: str  # what the CPU has, in words


_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = (*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
#: Widest first: the probe takes the first this CPU can run.
VARIANTS = (
    Variant(
        "avx512_bf16",
        _AVX512 | {"avx512_bf16"},
        (*_AVX512_FLAGS, "-mavx512bf16"),
        "AVX-512 (F, BW, VL, DQ) with AVX512-BF16",
    ),
    Variant("avx512", _AVX512, _AVX512_FLAGS, "AVX-512 (F, BW, VL, DQ) without AVX512-BF16"),
    Variant("avx2", _AVX2, _AVX2_FLAGS, "AVX2, FMA and F16C but not AVX-512"),
)
BY_NAME = {v.name: v for v in VARIANTS}

# (q [B, Hkv, G, D] a row per query token, layer_kv [2, Hkv, slots, D], tables [B, n]
#  long, lens [B] long: the keys each row sees, block_size, scale) -> [B, Hkv, G, D]
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]


@dataclass(frozen=True)
class CpuKernels:
    """The kernels a model on the CPU runs through; each matches the eager op it replaces
    (``layers.py`` holds those) up to fp32 summation order."""

    variant: str
    paged_attention: PagedAttention | None  # None: the head dim has no instantiation
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> RMSNorm(residual + x); the sum is left in residual
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]  # [..., 2n] -> [..., n]
    # (qkv [T, (H + 2 Hkv) D], cos, sin [T, D/2], layer_kv, slots [T], H) -> rotated q
    # [T, H, D]; rotated k and v are written to layer_kv at the slots
    rope_and_cache: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor
    ]


@dataclass(frozen=True)
class Choice:
    """The variant this process runs (None: torch's ops) and why, in words."""

    variant: Variant | None
    why: str


def kernels_for(
    device: torch.device, dtype: torch.dtype, head_dim: int, variant: str | None = None
) -> CpuKernels | None:
    """The kernels for a model on ``device`` in ``dtype``, or None where torch's ops stay.
    ``variant`` None: the one ``$PDD_CPU_KERNELS`` and the CPU choose (``choose``)."""
    if device.type != "cpu" or dtype not in DTYPES:
        return None
    status = load_status(variant)
    module = status.module
    if module is None or status.variant is None:
        return None
    return CpuKernels(
        variant=status.variant,
        paged_attention=module.paged_attention if head_dim in HEAD_DIMS else None,
        rms_norm=module.rms_norm,
        add_rms_norm=module.add_rms_norm,
        silu_and_mul=module.silu_and_mul,
        rope_and_cache=module.rope_and_cache,
    )


def choose(flags: frozenset[str] | None = None, setting: str | None = None) -> Choice:
    """The variant for a CPU with ``flags`` (default: this one's) under ``setting``
    (default: ``$PDD_CPU_KERNELS``)."""
    flags = cpu_flags() if flags is None else flags
    setting = _setting() if setting is None else setting
    if setting == "off":
        return Choice(None, f"{ENV_CHOICE}=off")
    if setting in BY_NAME:
        wanted = BY_NAME[setting]
        missing = sorted(wanted.needs - flags)
        if missing:
            return Choice(None, f"{setting} asked for, but this CPU lacks {', '.join(missing)}")
        return Choice(wanted, f"{setting} asked for")
    if setting not in ("auto", "on"):
        names = ", ".join(["auto", "off", *BY_NAME])
        return Choice(None, f"{ENV_CHOICE}={setting!r} is not one of {names}")
    for candidate in VARIANTS:
        if candidate.needs <= flags:
            return Choice(candidate, f"the CPU has {candidate.about}")
    return Choice(None, "the CPU has neither AVX-512 nor AVX2 with FMA and F16C")


def _setting() -> str:
    return os.environ.get(ENV_CHOICE) or "auto"


def runnable() -> list[str]:
    """The variants this CPU can run, widest first."""
    flags = cpu_flags()
    return [v.name for v in VARIANTS if v.needs <= flags]


@dataclass(frozen=True)
class Status:
    """What ``obtain`` found: the variant and its module, or None and why (one line)."""

    variant: str | None
    module: ModuleType | None
    why: str
    log: Path | None = None


def load(variant: str | None = None) -> ModuleType | None:
    """The built kernels' module for ``variant`` (None: ``$PDD_CPU_KERNELS``'s choice),
    built if this machine has none yet; None where there is none."""
    return load_status(variant).module


def load_status(variant: str | None = None) -> Status:
    """``obtain``'s answer, once per process and setting, said in one log line: which
    variant runs and why, or why none does."""
    return _loaded(variant or _setting())


@cache
def _loaded(setting: str) -> Status:
    status = obtain(choose(setting=setting))
    if status.module is not None:
        log.info("CPU kernels: %s (%s)", status.variant, status.why)
    elif setting == "off":
        log.info("CPU kernels: off (%s=off), torch's ops instead", ENV_CHOICE)
    else:
        log.warning("CPU kernels: not used, torch's ops instead: %s", status.why)
    return status


def obtain(choice: Choice) -> Status:
    """Find or build, then import, the variant ``choice`` names, without logging
    (``load`` and ``main`` say the result, each in one line)."""
    variant = choice.variant
    if variant is None:
        return Status(None, None, choice.why)
    target = build_target(variant)
    try:
        outcome = build_once(target, lambda out: compile_command(variant, out), _wait_s())
    except OSError as exc:  # the cache cannot be written (read-only, full): not recorded
        return Status(variant.name, None, f"{variant.name}: cannot build in {target.root} ({exc})")
    if outcome.library is None:
        return Status(
            variant.name,
            None,
            f"{variant.name}: {outcome.problem}; compiler output in {outcome.log}",
            outcome.log,
        )
    try:
        module = _import(target.name, outcome.library)
    except Exception as exc:  # built but does not load (a missing symbol): record it too
        problem = f"the built library does not import ({exc})"
        record_failure(target, problem)
        return Status(variant.name, None, f"{variant.name}: {problem}", outcome.log)
    how = "built now" if outcome.built_now else "built earlier"
    return Status(variant.name, module, f"{choice.why}; {how}: {outcome.library}", outcome.log)


def build_target(variant: Variant) -> Target:
    """Where ``variant`` of this source, for this torch, Python and compiler, is built."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(
        f"{torch.__version__}|{sys.version_info[:2]}|{_compiler()}|{CFLAGS}|{variant.cflags}".encode()
    )
    root = os.environ.get(ENV_BUILD_DIR) or Path.home() / ".cache" / "pdd" / "extensions"
    return Target(Path(root), f"pdd_cpu_kernels_{variant.name}_{key.hexdigest()[:16]}")


def compile_command(variant: Variant, output: Path) -> list[str]:
    """One compiler call, compile and link, of the source into ``output``."""
    from torch.utils import cpp_extension  # only to build: it imports a lot

    name = output.name.removesuffix(".so")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libraries = [f"-L{p}" for p in cpp_extension.library_paths()]
    return [
        _compiler(),
        f"-DTORCH_EXTENSION_NAME={name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(arg for path in includes for arg in ("-isystem", path)),
        *CFLAGS,
        *variant.cflags,
        "-shared",
        str(SOURCE),
        "-o",
        str(output),
        *libraries,
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        "-ltorch_python",
    ]


def _compiler() -> str:
    """The C++ compiler: ``$CXX`` as torch's extension builder takes it, else ``c++``."""
    return os.environ.get("CXX") or "c++"


def _wait_s() -> float:
    try:
        return float(os.environ.get(ENV_WAIT, DEFAULT_WAIT_S))
    except ValueError:
        return DEFAULT_WAIT_S


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``); empty where there are none to read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_only(variant: Variant) -> Outcome:
    """Compile ``variant`` into the cache without loading it, for a CPU that may not be
    this one (a worker image carries every variant; the kernels are never run here)."""
    target = build_target(variant)
    return build_once(target, lambda out: compile_command(variant, out), _wait_s())


def main(argv: list[str] | None = None) -> None:
    """Build the kernels now (setup does this) and say in one line whether they are
    usable; with ``--variants``, build those for other CPUs (a worker image), one line
    each, and exit 1 if any failed."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "--variants", nargs="+", choices=list(BY_NAME), help="build these without loading them"
    )
    args = parser.parse_args(argv)
    if args.variants:
        failed = 0
        for name in args.variants:
            outcome = build_only(BY_NAME[name])
            failed += outcome.library is None
            said = outcome.library or f"failed: {outcome.problem}; compiler output in {outcome.log}"
            print(f"CPU kernels {name}: {said}")
        sys.exit(1 if failed else 0)
    status = obtain(choose())
    if status.module is not None:
        compiled = f"; compiler log: {status.log}" if status.log and status.log.exists() else ""
        print(f"CPU kernels: {status.variant} ({status.why}{compiled})")
    else:
        print(f"CPU kernels: not built, the engine will use torch's ops: {status.why}")

