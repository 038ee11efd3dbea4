"""The CPU allocator's thresholds: a step-sized block stays on the heap once they are set."""

import subprocess
import sys
import textwrap

import pytest

from pdd.worker.engine import cpu_allocator

#: In a fresh interpreter: malloc 16 MiB and report how many more blocks glibc serves
#: with mmap after it (mallinfo2's hblks); argv[1] == "set": the thresholds first.
PROBE = textwrap.dedent(
    """
    import ctypes, sys
    from pdd.worker.engine.cpu_allocator import keep_freed_memory
    if sys.argv[1] == "set":
        assert keep_freed_memory()
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    before = libc.mallinfo2().hblks
    block = libc.malloc(16 << 20)
    print(libc.mallinfo2().hblks - before)
    """
)


def _mmapped_blocks(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@pytest.mark.integration
@pytest.mark.skipif(cpu_allocator._glibc() is None, reason="glibc's malloc only")
def test_a_step_sized_block_comes_from_the_heap_once_the_thresholds_are_set():
    """glibc's default serves 16 MiB with mmap (and munmap on free: fresh pages every
    step); with the engine's thresholds it comes from the heap, where freed memory stays."""
    assert _mmapped_blocks("default") == 1
    assert _mmapped_blocks("set") == 0


@pytest.mark.unit
def test_the_thresholds_are_set_once_per_process(monkeypatch):
    calls = []
    cpu_allocator.keep_freed_memory.cache_clear()
    monkeypatch.setattr(cpu_allocator, "_set_thresholds", lambda: calls.append(1) or True)
    assert cpu_allocator.keep_freed_memory() and cpu_allocator.keep_freed_memory()
    assert calls == [1]
    cpu_allocator.keep_freed_memory.cache_clear()


@pytest.mark.unit
def test_an_engine_on_the_cpu_sets_them(monkeypatch, hf_checkpoint):
    from pdd.worker.engine import Engine, engine

    calls = []
    monkeypatch.setattr(engine, "keep_freed_memory", lambda: calls.append(1) or True)
    Engine(str(hf_checkpoint("llama")), block_size=8, num_blocks=16)
    assert calls == [1]
