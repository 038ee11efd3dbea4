"""The CPU allocator's thresholds: a step-sized block stays on the heap once they are set."""

import os
import subprocess
import sys
import textwrap

import pytest

from pdd.worker import cpu_allocator

#: In a fresh interpreter: malloc 16 MiB and report how many more blocks glibc serves
#: with mmap after it (mallinfo2's hblks); argv[1] == "set": the thresholds first.
PROBE = textwrap.dedent(
    """
    import ctypes, sys
    from pdd.worker.cpu_allocator import keep_freed_memory
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


@pytest.mark.unit
@pytest.mark.parametrize(
    ("environ", "preload"),
    [
        ({"PDD_TCMALLOC": "/opt/tc/libtcmalloc.so"}, "/opt/tc/libtcmalloc.so"),
        (
            {"PDD_TCMALLOC": "/opt/tc/libtc.so", "LD_PRELOAD": "/x/libiomp5.so"},
            "/opt/tc/libtc.so:/x/libiomp5.so",
        ),
        ({"PDD_TCMALLOC": "off"}, None),
        ({"PDD_TCMALLOC": "/opt/tc/libtc.so", "LD_PRELOAD": "/opt/tc/libtc.so"}, None),
        ({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, None),
    ],
)
def test_tcmalloc_goes_first_in_the_preload_once(monkeypatch, environ, preload):
    """Prepended to what is preloaded already; never again once named there (a start
    whose preload the loader refused must not start again, and again)."""
    monkeypatch.setattr(sys, "platform", "linux")
    found = cpu_allocator.preload_environment(environ)
    assert (found and found["LD_PRELOAD"]) == preload
    if found:
        assert found["PDD_TCMALLOC"] == environ["PDD_TCMALLOC"]


@pytest.mark.unit
def test_without_tcmalloc_installed_nothing_starts_again(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(cpu_allocator.ctypes.util, "find_library", lambda name: None)
    assert cpu_allocator.preload_environment({}) is None


#: In a fresh interpreter: start again under tcmalloc, then report whether it is loaded.
REEXEC = (
    "import os; from pdd.worker import cpu_allocator as a; a.reexec_with_tcmalloc(); "
    "print(os.getpid(), a.tcmalloc_loaded(), os.environ.get('LD_PRELOAD', ''))"
)


def _reexec(setting: str) -> tuple[int, list[str]]:
    env = {**os.environ, "PDD_TCMALLOC": setting}
    env.pop("LD_PRELOAD", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", REEXEC], env=env, stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    return proc.pid, out.split()


@pytest.mark.integration
@pytest.mark.skipif(
    not cpu_allocator.tcmalloc_library("auto") or not sys.platform.startswith("linux"),
    reason="tcmalloc is not installed (Debian: libtcmalloc-minimal4)",
)
def test_a_process_starts_again_under_tcmalloc_with_its_pid():
    pid, (printed_pid, loaded, preload) = _reexec("auto")
    assert (int(printed_pid), loaded) == (pid, "True")
    assert "tcmalloc" in preload


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux's")
def test_a_library_the_loader_refuses_starts_the_process_again_only_once(tmp_path):
    """The loader warns and goes on without it: the process runs, on glibc, once more."""
    missing = str(tmp_path / "libnotthere.so")
    pid, (printed_pid, loaded, preload) = _reexec(missing)
    assert (int(printed_pid), loaded, preload) == (pid, "False", missing)
