"""Which device and dtype an engine runs on, and how much memory its KV cache may take.

Settings say what the deployment wants (``device: auto``, ``dtype: auto``, a KV cache
as a fraction of free device memory); this module turns them into what this machine
can give, through a ``DeviceProbe`` so tests can stand in for a GPU they do not have.

* ``auto`` device: CUDA when a CUDA device is visible (a pod that requests
  ``nvidia.com/gpu`` sees one), else the CPU.
* ``auto`` dtype: bfloat16 on CUDA; on a CPU with native bfloat16 (AVX512-BF16, AMX,
  Arm's BF16) the checkpoint's own dtype (float16 becomes float32 there, see
  ``pdd.worker.model.loader``); on a CPU without it float32, weights and KV cache,
  since bfloat16 arithmetic is emulated there and slower than float32. bfloat16 asked
  for on such a CPU runs, with a warning: weights and KV cache in bfloat16, the
  projections computed in float32 from a widened copy of their weights
  (``pdd.worker.model.layers.pack_dtype``). The choice and its
  reason are said at start and on ``/health`` (``EngineInfo.dtype_reason``). Tiers on
  different CPU families may resolve ``auto`` differently, and KV moves between tiers
  only in one dtype: set the dtype explicitly for such a deployment.
* KV cache by fraction: that share of the device memory still free once the weights
  are loaded, the way vLLM's ``gpu-memory-utilization`` and SGLang's
  ``mem-fraction-static`` size theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdd.worker.engine.config import EngineConfig, EngineConfigError
from pdd.worker.model.loader import LoadedModel, load_model

DEVICES = ("auto", "cpu", "cuda")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceProbe:
    """What this machine has; ``SYSTEM_PROBE`` asks torch and the OS, tests fake it."""

    cuda_available: Callable[[], bool]
    free_memory_bytes: Callable[[torch.device], int]
    cpu_has_bf16: Callable[[], bool]


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return _mem_available_bytes()


def _mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The kernel's estimate of memory available to a new process (``MemAvailable``)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise EngineConfigError(f"{meminfo} has no MemAvailable line; give the KV cache in GiB")


#: CPU feature flags (``/proc/cpuinfo``) that mean native bfloat16 arithmetic.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def _cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Native bfloat16 on this CPU: AVX-512 BF16 or AMX on x86, the BF16 extension on Arm."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features") and BF16_CPU_FLAGS & set(value.split()):
            return True
    return False


SYSTEM_PROBE = DeviceProbe(torch.cuda.is_available, _free_memory_bytes, _cpu_has_bf16)


def resolve_device(requested: str, probe: DeviceProbe = SYSTEM_PROBE) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> the device to run on."""
    if requested == "auto":
        return torch.device("cuda" if probe.cuda_available() else "cpu")
    unknown = f"device {requested!r} is not one of {DEVICES} (or cuda:N)"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise EngineConfigError(unknown) from None
    if device.type not in ("cpu", "cuda"):
        raise EngineConfigError(unknown)
    if device.type == "cuda" and not probe.cuda_available():
        raise EngineConfigError(
            f"device {requested!r} asked for, but no CUDA device is visible: request "
            "nvidia.com/gpu for the pod, or use device auto"
        )
    return device


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype to load in (None: the checkpoint's own, which the loader decides), why,
    and a warning to log where the choice is a poor fit for this machine."""

    name: str | None
    reason: str
    warning: str | None = None


NO_NATIVE_BF16 = "this CPU has no native bfloat16 (AVX512-BF16 or AMX)"


def resolve_dtype(
    requested: str | None, device: torch.device, probe: DeviceProbe = SYSTEM_PROBE
) -> DtypeChoice:
    """The dtype to load in, resolved against this machine (see the module's docstring)."""
    if requested in (None, "auto"):
        if device.type == "cuda":
            return DtypeChoice("bfloat16", "auto: bfloat16 on CUDA")
        if not probe.cpu_has_bf16():
            return DtypeChoice("float32", f"auto: float32, {NO_NATIVE_BF16}")
        return DtypeChoice(None, "auto: the checkpoint's own, this CPU has native bfloat16")
    if requested == "bfloat16" and device.type == "cpu" and not probe.cpu_has_bf16():
        return DtypeChoice(
            "bfloat16",
            f"asked for, though {NO_NATIVE_BF16}",
            f"dtype bfloat16 asked for, but {NO_NATIVE_BF16}: its arithmetic is emulated, "
            "the projections run in float32 from a widened copy of the weights (their "
            "memory as float32's), slower than float32 here; dtype auto would run float32",
        )
    return DtypeChoice(requested, "asked for")


def kv_budget_bytes(
    fraction: float, device: torch.device, probe: DeviceProbe = SYSTEM_PROBE
) -> int:
    """``fraction`` of the memory free on ``device`` now (call it after the weights load)."""
    if not 0 < fraction <= 1:
        raise EngineConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")
    return int(probe.free_memory_bytes(device) * fraction)


def load_on_device(
    model: str, config: EngineConfig, probe: DeviceProbe = SYSTEM_PROBE
) -> tuple[LoadedModel, str]:
    """``model`` loaded on the device and in the dtype ``config`` asks for, as this
    machine can run them; and why that dtype (``EngineInfo.dtype_reason``)."""
    device = resolve_device(config.device, probe)
    dtype = resolve_dtype(config.dtype, device, probe)
    if dtype.warning:
        log.warning("%s", dtype.warning)
    return load_model(model, dtype=dtype.name, device=device), dtype.reason
