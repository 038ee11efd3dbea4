"""The engine's compiled CPU kernels (``cpu_kernels.cpp``), built once, and their probe.

Attention over the paged cache (every query token of a step: decode and prefill
alike), residual add + RMSNorm, SiLU-and-mul, and RoPE with the cache write: what a
step spends most outside its matmuls when each is a chain of eager torch ops (the
.cpp says why each exists).
The source is compiled once per machine (``scripts/setup.sh`` calls ``main``;
otherwise the first worker that needs it builds it) into a cache directory keyed by
the source, torch's version and the CPU's flags, because it is compiled for the CPU
it runs on (``-march=native``). Later processes import the built module directly,
without torch's build lock.

Where the kernels do not apply (an accelerator, a dtype other than bf16/fp32) or
cannot be built (no C++ compiler, no AVX-512), the model runs torch's own ops
(attention through SDPA), so the kernels are a speed-up, never a requirement.
``PDD_CPU_KERNELS=off`` chooses torch's ops on purpose (to compare, or to rule the
kernels out).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, inlined from its header;
# without the flag the pragma is ignored and every kernel runs on one thread.
# -ffp-contract=off: a product followed by a sum stays two roundings, as in the eager
# ops the row-wise kernels reproduce (GCC would otherwise fuse them into one FMA).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
HEAD_DIMS = frozenset({16, 32, 64, 80, 96, 128, 256})  # attention's instantiations
DTYPES = frozenset({torch.bfloat16, torch.float32})
ENV_CHOICE = "PDD_CPU_KERNELS"  # "on" (default) or "off"
ENV_BUILD_DIR = "PDD_EXTENSIONS_DIR"

# (q [B, Hkv, G, D] a row per query token, layer_kv [2, Hkv, slots, D], tables [B, n]
#  long, lens [B] long: the keys each row sees, block_size, scale) -> [B, Hkv, G, D]
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]


@dataclass(frozen=True)
class CpuKernels:
    """The kernels a model on the CPU runs through; each matches the eager op it replaces
    (``layers.py`` holds those) up to fp32 summation order."""

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


def kernels_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> CpuKernels | None:
    """The kernels for a model on ``device`` in ``dtype``, or None where torch's ops stay."""
    if os.environ.get(ENV_CHOICE, "on") == "off":
        return None
    if device.type != "cpu" or dtype not in DTYPES:
        return None
    module = load()
    if module is None:
        return None
    return CpuKernels(
        paged_attention=module.paged_attention if head_dim in HEAD_DIMS else None,
        rms_norm=module.rms_norm,
        add_rms_norm=module.add_rms_norm,
        silu_and_mul=module.silu_and_mul,
        rope_and_cache=module.rope_and_cache,
    )


@cache
def load() -> ModuleType | None:
    """The built kernels' module (building it if this machine has none yet), or None."""
    directory = build_directory()
    name = directory.name
    built = directory / f"{name}.so"
    try:
        if built.exists():
            return _import(name, built)
        from torch.utils import cpp_extension  # only to build: it imports a lot

        directory.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
        )
    except Exception as exc:  # any build or import failure: SDPA, said once
        log.warning("CPU kernels unavailable, using torch's ops: %s", exc)
        return None


def build_directory() -> Path:
    """Where this source, for this torch and this CPU, is built."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(f"{torch.__version__}|{sys.version_info[:2]}|{CFLAGS}|{_cpu_flags()}".encode())
    root = os.environ.get(ENV_BUILD_DIR) or Path.home() / ".cache" / "pdd" / "extensions"
    return Path(root) / f"pdd_cpu_kernels_{key.hexdigest()[:16]}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return "unknown"


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    """Build the kernels now (setup does this) and say whether they are usable."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    if module is None:
        print("CPU kernels: not built; the engine will use torch's ops (SDPA) on the CPU")
    else:
        print(f"CPU kernels: built in {build_directory()}")
