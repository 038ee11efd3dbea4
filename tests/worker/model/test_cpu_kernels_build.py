"""Building the CPU kernels never blocks and never repeats a failure: a builder killed at
any point (SIGINT to its process group, as Ctrl-C on ``pdd up``; SIGKILL, as a pod
killed mid-build) leaves nothing a later process waits on; a failed build is recorded
once and not retried; the compiler's output goes to a log file, never to the log.

The kill test drives the real build machinery (``cpu_kernels_build``) in child
processes with a stand-in compiler that takes a while and writes its output in two
parts, so the kills land before, during and after the compile and around the rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdd.worker.model import cpu_kernels as ck
from pdd.worker.model import cpu_kernels_build as ckb
from pdd.worker.model.cpu_kernels_build import Target, build_once

pytestmark = pytest.mark.integration

BUILD_MODULE = Path(ckb.__file__)
HANG_GUARD_S = 120  # only catches a hang; a good run takes about a second
WAITING = "waiting for another process"

# Loads the build module by path (not through pdd.worker.model, which imports torch) and
# builds the target with the stand-in compiler; prints what it got.
CHILD = textwrap.dedent(
    """
    import importlib.util, logging, sys
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = importlib.util.spec_from_file_location("ckb", sys.argv[1])
    ckb = sys.modules["ckb"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ckb)
    target = ckb.Target(Path(sys.argv[2]), "kernels")
    outcome = ckb.build_once(target, lambda out: [sys.argv[3], "-o", str(out)], float(sys.argv[4]))
    print("LIBRARY", outcome.library)
    print("PROBLEM", outcome.problem)
    """
)


def _slow_compiler(directory: Path, exit_code: int = 0) -> Path:
    """A stand-in compiler: counts its runs, says something on stderr, writes its output
    in two parts with pauses around them, exits with ``exit_code``."""
    script = directory / "fake-c++"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            echo run >> "{directory}/runs"
            echo "FAKE-COMPILER-DIAGNOSTIC: something about line 1" >&2
            while [ "$1" != "-o" ]; do shift; done
            out="$2"
            sleep 0.2
            printf 'first half ' > "$out"
            sleep 0.3
            printf 'second half' >> "$out"
            sleep 0.1
            exit {exit_code}
            """
        )
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _runs(directory: Path) -> int:
    runs = directory / "runs"
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def _child(cache: Path, compiler: Path, wait_s: float = 30.0, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(BUILD_MODULE), str(cache), str(compiler), str(wait_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def test_a_build_killed_at_any_point_never_holds_up_the_next_process(tmp_path) -> None:
    rng = random.Random(34)
    for attempt in range(8):
        cache = tmp_path / f"cache{attempt}"
        compiler = _slow_compiler(tmp_path)
        first = _child(cache, compiler, start_new_session=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            first.wait(timeout=rng.uniform(0.0, 1.0))  # a random point of the build
        how = (signal.SIGINT, signal.SIGKILL)[attempt % 2]
        # The builder and its compiler, as Ctrl-C does; if it had already finished, a
        # later process must simply use its build.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, how)
        first.communicate(timeout=HANG_GUARD_S)

        second = _child(cache, compiler)
        out, err = second.communicate(timeout=HANG_GUARD_S)
        assert second.returncode == 0, err
        assert WAITING not in err, f"attempt {attempt} ({how.name}): waited on a dead builder"
        library = cache / "kernels.so"
        assert f"LIBRARY {library}" in out
        assert library.read_text() == "first half second half"  # never a partial library
        assert not list(cache.glob("kernels.build-*"))  # leftovers cleaned up


def test_a_stale_lock_file_of_any_version_is_no_obstacle(tmp_path) -> None:
    """Older versions built under torch's ``lock`` file, in a directory per build; a
    leftover one (and a leftover lock file of this version's naming) must not stop a
    build: only a live OS lock can make anyone wait."""
    cache = tmp_path / "cache"
    old_build = cache / "pdd_cpu_kernels_14211f43d544a716"
    old_build.mkdir(parents=True)
    (old_build / "lock").write_text("")
    (cache / "kernels.lock").write_text("999999999\n")  # its owner is long gone
    compiler = _slow_compiler(tmp_path)
    child = _child(cache, compiler)
    _, err = child.communicate(timeout=HANG_GUARD_S)
    assert child.returncode == 0 and WAITING not in err
    assert (cache / "kernels.so").read_text() == "first half second half"


def test_processes_starting_together_build_once_and_all_get_it(tmp_path) -> None:
    """Several workers starting beside each other: one compiles, the others wait for it
    (the lock is live) and load its library; none sees a half-built one."""
    cache, compiler = tmp_path / "cache", _slow_compiler(tmp_path)
    children = [_child(cache, compiler) for _ in range(3)]
    for child in children:
        out, err = child.communicate(timeout=HANG_GUARD_S)
        assert child.returncode == 0, err
        assert f"LIBRARY {cache / 'kernels.so'}" in out
    assert _runs(tmp_path) == 1
    assert (cache / "kernels.so").read_text() == "first half second half"


def test_a_waiter_gives_up_after_its_bound_on_a_live_builder(tmp_path) -> None:
    """A builder that is alive but never finishes (stopped, hung) delays others only by
    their bound; they go on without the library and record nothing."""
    target = Target(tmp_path, "kernels")
    tmp_path.mkdir(exist_ok=True)
    holder = os.open(target.lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: conflicts as another process
    try:
        outcome = build_once(target, lambda out: ["true"], wait_s=0.3)
    finally:
        os.close(holder)
    assert outcome.library is None and "held" in outcome.problem
    assert not target.failure.exists()  # not a failure: the next process tries again


def test_a_failed_build_is_recorded_and_never_retried(tmp_path) -> None:
    cache, compiler = tmp_path / "cache", _slow_compiler(tmp_path, exit_code=1)
    for _ in range(2):
        child = _child(cache, compiler)
        out, err = child.communicate(timeout=HANG_GUARD_S)
        assert child.returncode == 0, err
        assert "LIBRARY None" in out and "PROBLEM the compiler exited with 1" in out
        assert "FAKE-COMPILER-DIAGNOSTIC" not in out + err  # the compiler's output: log only
    assert _runs(tmp_path) == 1  # the second process read the record instead
    record = json.loads((cache / "kernels.failed").read_text())
    assert record["log"] == str(cache / "kernels.log")
    assert "FAKE-COMPILER-DIAGNOSTIC" in (cache / "kernels.log").read_text()
    assert not (cache / "kernels.so").exists()


# --- the kernels' own build: a machine whose compiler fails --------------------------------
SETUP_LINE = "from pdd.worker.model.cpu_kernels import main; main()"


def test_setup_says_one_line_and_names_the_log_when_the_compiler_fails(tmp_path) -> None:
    """What ``scripts/setup.sh`` prints on a machine whose compiler cannot build the
    kernels (here a bogus compiler flag, through $CXX), and that no later process, at
    INFO, compiles again or shows the compiler's output."""
    compiler = tmp_path / "c++"
    compiler.write_text(f'#!/bin/sh\necho run >> "{tmp_path}/runs"\nexec c++ -mbogus-flag "$@"\n')
    compiler.chmod(0o755)
    env = {**os.environ, ck.ENV_BUILD_DIR: str(tmp_path / "cache"), "CXX": str(compiler)}
    env.pop(ck.ENV_CHOICE, None)
    setup = subprocess.run(
        [sys.executable, "-c", SETUP_LINE], env=env, capture_output=True, text=True,
        timeout=HANG_GUARD_S, check=True,
    )  # fmt: skip
    lines = (setup.stdout + setup.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    if not ck.runnable():
        assert "not built" in lines[0] and "neither" in lines[0]
        return
    logs = list((tmp_path / "cache").glob("*.log"))
    assert len(logs) == 1 and str(logs[0]) in lines[0] and "not built" in lines[0]
    assert "bogus" in logs[0].read_text()  # the compiler's complaint, kept for a person

    later = subprocess.run(
        [sys.executable, "-c", LATER_PROCESS], env=env, capture_output=True, text=True,
        timeout=HANG_GUARD_S, check=True,
    )  # fmt: skip
    assert _runs(tmp_path) == 1
    said = later.stdout + later.stderr
    assert "bogus" not in said and "error" not in said.lower()
    assert said.count("CPU kernels: not used") == 1 and "kernels None" in said


LATER_PROCESS = textwrap.dedent(
    """
    import logging, torch
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from pdd.worker.model import cpu_kernels as ck
    for _ in range(3):  # several models in one process: said once
        kernels = ck.kernels_for(torch.device("cpu"), torch.float32, 64)
    print("kernels", kernels)
    """
)


def test_the_probe_picks_the_widest_variant_the_cpu_runs() -> None:
    epyc_zen2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
    cooper_lake = epyc_zen2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    skylake_sp = cooper_lake - {"avx512_bf16"}
    assert ck.choose(epyc_zen2, "auto").variant.name == "avx2"
    assert "not AVX-512" in ck.choose(epyc_zen2, "auto").why
    assert ck.choose(skylake_sp, "auto").variant.name == "avx512"
    assert ck.choose(cooper_lake, "auto").variant.name == "avx512_bf16"
    assert ck.choose(cooper_lake, "avx2").variant.name == "avx2"  # forced narrower
    refused = ck.choose(epyc_zen2, "avx512")  # never run code the CPU lacks
    assert refused.variant is None and "avx512f" in refused.why
    assert ck.choose(frozenset({"sse4_2", "avx"}), "auto").variant is None
    assert ck.choose(frozenset(), "auto").variant is None  # not x86 at all
    assert ck.choose(cooper_lake, "off").variant is None
    assert "not one of" in ck.choose(cooper_lake, "avx9").why


def test_a_failed_kernel_build_leaves_the_model_on_torchs_ops(tmp_path, monkeypatch) -> None:
    if not ck.runnable():
        pytest.skip("no kernel variant for this CPU: nothing to build")
    monkeypatch.setenv(ck.ENV_BUILD_DIR, str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    status = ck.obtain(ck.choose())
    assert status.module is None and "cannot run the compiler" in status.why
    assert ck.build_target(ck.choose().variant).failure.exists()
    assert ck.obtain(ck.choose()).why == status.why  # from the record


def test_an_image_build_compiles_every_variant_where_workers_look_for_them(
    tmp_path, monkeypatch
) -> None:
    """``main(--variants ...)`` (the worker image's build step) compiles each variant,
    whatever the builder's CPU, into the very paths a worker's lookup reads, and never
    loads them (the builder may lack the instructions)."""
    monkeypatch.setenv(ck.ENV_BUILD_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(_slow_compiler(tmp_path)))  # part of the cache key
    names = ["avx2", "avx512", "avx512_bf16"]
    built = subprocess.run(
        [sys.executable, "-c", SETUP_LINE, "--variants", *names], capture_output=True,
        text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert len(built.stdout.strip().splitlines()) == len(names) == _runs(tmp_path)
    for name in names:
        assert ck.build_target(ck.BY_NAME[name]).library.read_text() == "first half second half"
