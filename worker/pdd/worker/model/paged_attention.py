"""Decode attention over the paged cache on the CPU: the C++ kernel and its probe.

``paged_attention.cpp`` is compiled once per machine (``scripts/setup.sh`` calls
``main``; otherwise the first worker that needs it builds it) into a cache directory
keyed by the source, torch's version and the CPU's flags, because it is compiled for
the CPU it runs on (``-march=native``). Later processes import the built module
directly, without torch's build lock.

Where it does not apply (an accelerator, a dtype other than bf16/fp32, an
unsupported head dim) or cannot be built (no C++ compiler, no AVX-512), the model
keeps attending through SDPA, so the kernel is a speed-up, never a requirement.
``PDD_CPU_ATTENTION=sdpa`` chooses SDPA on purpose (to compare the two, or to rule
the kernel out).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
CFLAGS = ("-O3", "-march=native")
HEAD_DIMS = frozenset({16, 32, 64, 80, 96, 128, 256})  # the kernel's instantiations
DTYPES = frozenset({torch.bfloat16, torch.float32})
ENV_CHOICE = "PDD_CPU_ATTENTION"  # "kernel" (default) or "sdpa"
ENV_BUILD_DIR = "PDD_EXTENSIONS_DIR"

# (q [B, Hkv, G, D], layer_kv [2, Hkv, slots, D], tables [B, n] long, lens [B] long,
#  block_size, scale) -> [B, Hkv, G, D]
DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]


def decode_attention_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> DecodeAttention | None:
    """The kernel for a model on ``device`` in ``dtype``, or None where SDPA stays."""
    if os.environ.get(ENV_CHOICE, "kernel") == "sdpa":
        return None
    if device.type != "cpu" or dtype not in DTYPES or head_dim not in HEAD_DIMS:
        return None
    module = load()
    return None if module is None else module.decode_attention


@cache
def load() -> ModuleType | None:
    """The built kernel module (building it if this machine has none yet), or None."""
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
            build_directory=str(directory),
        )
    except Exception as exc:  # any build or import failure: SDPA, said once
        log.warning("paged decode attention kernel unavailable, using SDPA: %s", exc)
        return None


def build_directory() -> Path:
    """Where this source, for this torch and this CPU, is built."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(f"{torch.__version__}|{sys.version_info[:2]}|{CFLAGS}|{_cpu_flags()}".encode())
    root = os.environ.get(ENV_BUILD_DIR) or Path.home() / ".cache" / "pdd" / "extensions"
    return Path(root) / f"pdd_paged_attention_{key.hexdigest()[:16]}"


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
    """Build the kernel now (setup does this) and say whether it is usable."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    if module is None:
        print("paged decode attention kernel: not built; the engine will use SDPA on the CPU")
    else:
        print(f"paged decode attention kernel: built in {build_directory()}")
