"""Keep freed memory in the process on the CPU, so a step's tensors reuse it.

Every engine step allocates and frees the same activations again (at 32 sequences of
the 200M preset a projection's output is 0.7 MB; a 512-token prefill chunk's, 11.5 MB).
glibc's malloc serves blocks from 128 KiB up with ``mmap`` and hands them back with
``munmap`` when freed (its threshold adapts, but upwards only to the largest block
freed so far), and trims the heap's top back to the kernel: so each step pays for
fresh pages, zeroed and faulted in again.

Two remedies, the first where it can be had:

- **tcmalloc, preloaded** (``reexec_with_tcmalloc``), as vLLM's CPU backend does for its
  engine process: its per-size free lists keep what a step freed. ``LD_PRELOAD`` acts
  only when a process starts, so ``pdd worker`` and ``pdd generate`` execute themselves
  again, same pid and arguments, with the library first in ``LD_PRELOAD`` where the
  loader finds it (Debian's ``libtcmalloc-minimal4``; the worker image installs it).
  ``PDD_TCMALLOC``: ``auto`` (the default), ``off``, or the library's path.
- **glibc's own thresholds** (``keep_freed_memory``, called when an engine is built on
  the CPU): ``mallopt`` keeps blocks up to ``MMAP_THRESHOLD_BYTES`` on the heap, grows it
  ``TOP_PAD_BYTES`` at a time and trims it only past ``TRIM_THRESHOLD_BYTES``. Nothing
  to install; a worker owns its machine's memory anyway. Skipped under tcmalloc.

Measured with ``bench/engine.py`` (200M preset, float32, 2 threads, on an emulated
AVX2-only CPU, best of 2): our mixed workload 141.0 tok/s with glibc's defaults, 150.7
with tcmalloc preloaded, 144.9-147.5 with these thresholds; see docs/engine.md.
Anything but glibc (musl, macOS) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Mapping

log = logging.getLogger(__name__)

#: How to choose the allocator: ``auto`` (tcmalloc where the loader finds it), ``off``,
#: or a path to the library to preload.
TCMALLOC_ENV = "PDD_TCMALLOC"
#: The names the loader knows tcmalloc by: the minimal build first (no heap profiler).
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")

#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap: glibc's largest allowed on 64-bit.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: The heap's free top goes back to the kernel only past this.
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024
#: The heap grows by at least this much at a time (fewer ``brk`` calls while it fills).
TOP_PAD_BYTES = 256 * 1024 * 1024


def tcmalloc_library(setting: str) -> str | None:
    """The tcmalloc to preload for a ``PDD_TCMALLOC`` setting, or None for none."""
    if setting == "off":
        return None
    if setting != "auto":
        return setting
    for name in TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def preload_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """``environ`` with tcmalloc first in ``LD_PRELOAD``; None where this process needs
    no new start: not Linux, off, not installed, or already named there (also after a
    start whose preload the loader refused: so never a loop)."""
    preload = environ.get("LD_PRELOAD", "")
    if not sys.platform.startswith("linux") or "tcmalloc" in preload:
        return None
    library = tcmalloc_library(environ.get(TCMALLOC_ENV, "auto"))
    if library is None or library in preload.split(":"):
        return None
    return {**environ, "LD_PRELOAD": f"{library}:{preload}" if preload else library}


def reexec_with_tcmalloc() -> None:
    """Execute this process again with tcmalloc preloaded, where ``preload_environment``
    says so; else return. Call it first thing in a program's entry point, never from a
    library call (it replaces the running program)."""
    environ = preload_environment(os.environ)
    if environ is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)


def tcmalloc_loaded() -> bool:
    """Whether this process's malloc is tcmalloc's (its own symbols are loaded)."""
    try:
        return hasattr(ctypes.CDLL(None), "tc_malloc")
    except OSError:
        return False


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; True where freed memory stays (under
    tcmalloc, or the thresholds set now or before). Safe to call from every engine: only
    the first call acts."""
    if tcmalloc_loaded():
        log.info("CPU allocator: tcmalloc (preloaded)")
        return True
    return _set_thresholds()


def _set_thresholds() -> bool:
    libc = _glibc()
    if libc is None:
        log.info("CPU allocator: left as it is (not glibc)")
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    ok = mallopt(M_TOP_PAD, TOP_PAD_BYTES) == 1 and ok
    if ok:
        log.info(
            "CPU allocator: glibc (no tcmalloc preloaded) keeps freed blocks up to %d MiB "
            "and trims past %d MiB",
            MMAP_THRESHOLD_BYTES >> 20,
            TRIM_THRESHOLD_BYTES >> 20,
        )
    else:
        log.warning("CPU allocator: glibc refused the thresholds; left at its defaults")
    return ok


def _glibc() -> ctypes.CDLL | None:
    """This process's C library, if it is glibc (the symbols already loaded: no search,
    no ``ldconfig`` run)."""
    try:
        libc = ctypes.CDLL(None)
        gnu_get_libc_version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    gnu_get_libc_version.restype = ctypes.c_char_p
    return libc if gnu_get_libc_version() else None
