"""Keep freed memory in the process on the CPU, so a step's tensors reuse it.

Every engine step allocates and frees the same activations again (at 32 sequences of
the 200M preset a projection's output is 0.7 MB; a 512-token prefill chunk's, 11.5 MB).
glibc's malloc serves blocks from 128 KiB up with ``mmap`` and hands them back with
``munmap`` when freed (its threshold adapts, but upwards only to the largest block
freed so far), and trims the heap's top back to the kernel: so each step pays for
fresh pages, zeroed and faulted in again. vLLM's CPU backend avoids this by preloading
tcmalloc into its engine process; LD_PRELOAD only works from a process's start and
tcmalloc is a system package, so the engine instead tells glibc's own malloc
(``mallopt``) to keep blocks up to ``MMAP_THRESHOLD_BYTES`` on its heap, to grow it
``TOP_PAD_BYTES`` at a time and to trim it only past ``TRIM_THRESHOLD_BYTES``. The
memory freed stays with the process, as it would under tcmalloc; a worker owns its
machine's memory anyway.

Measured with ``bench/engine.py`` (200M preset, float32, 2 threads, on an emulated
AVX2-only CPU, best of 2, within 20 minutes): our mixed workload 141.0 tok/s with
glibc's defaults, 150.7 with tcmalloc preloaded, 151.7 with these thresholds (set
through glibc's environment variables for that run); see docs/engine.md.

Anything but glibc (musl, macOS) is left as it is; under a preloaded tcmalloc the call
reaches tcmalloc's ``mallopt``, which keeps freed memory whatever it is told.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

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


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; True where they are set (now or before).
    Safe to call from every engine: only the first call acts."""
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
            "CPU allocator: glibc keeps freed blocks up to %d MiB and trims past %d MiB",
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
