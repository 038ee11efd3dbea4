"""vLLM as a baseline of ``bench/engine.py``, through another interpreter (``--vllm-python``).

vLLM lives in its own virtual environment (docs/engine.md says how to make one for the
CPU); this module never imports it. ``probe`` says why that interpreter cannot serve
(so the bench skips the vLLM side with that reason), ``VllmBaseline`` starts
``vllm_driver.py`` there and sends it token-id prompts, and ``token_agreement`` compares
its greedy tokens with ours. Standard library only, so the bench's unit tests import it
cheaply.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_driver import MARKER

DRIVER = Path(__file__).with_name("vllm_driver.py")
# where the environment lives (its lib/ holds the bundled libiomp5) and the tcmalloc that
# its loader finds (Debian's libtcmalloc-minimal4), or None
_PROBE = (
    "import ctypes.util, sys, vllm; "
    "print(sys.prefix); print(ctypes.util.find_library('tcmalloc_minimal') or '')"
)


class VllmUnavailableError(RuntimeError):
    """The vLLM side cannot run; the message says why, for the bench's skip line."""


@dataclass(frozen=True)
class VllmEnv:
    """What ``probe`` found of an interpreter that imports vLLM."""

    prefix: Path
    tcmalloc: str | None


def probe(python: str | None, timeout_s: float = 300.0) -> VllmEnv:
    """``python``'s environment where it imports vllm, else VllmUnavailableError."""
    if not python:
        raise VllmUnavailableError("no --vllm-python given (nor PDD_VLLM_PYTHON)")
    if not os.access(python, os.X_OK):
        raise VllmUnavailableError(f"{python} is not an executable interpreter")
    done = subprocess.run(
        [python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VllmUnavailableError(f"{python} cannot import vllm: {last}")
    prefix, tcmalloc = done.stdout.splitlines()[-2:]
    return VllmEnv(Path(prefix), tcmalloc or None)


def driver_env(found: VllmEnv, threads: int, kv_gib: int) -> dict[str, str]:
    """The environment vLLM for CPU wants: tcmalloc and its bundled libiomp5 preloaded,
    ``threads`` cores bound for compute, and a KV cache of ``kv_gib`` GiB."""
    preload = [str(p) for p in (found.prefix / "lib").glob("libiomp5.so")]
    if found.tcmalloc:
        preload.insert(0, found.tcmalloc)
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=":".join(preload),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
    )
    return env


class VllmBaseline:
    """One vLLM engine in a driver process, kept alive so its rounds alternate with ours."""

    def __init__(self, python: str, settings: dict, env: dict[str, str], log: Path) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(settings, f)
        self._settings = Path(f.name)
        self._log = log.open("w")
        self._proc = subprocess.Popen(
            [python, str(DRIVER), f.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.versions = self._read()

    def _read(self) -> dict:
        """The driver's next answer; its log lines go to the log file."""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(MARKER):
                return json.loads(line[len(MARKER) :])
            self._log.write(line)
        raise VllmUnavailableError(f"the vLLM driver exited (see {self._log.name})")

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list]:
        """Seconds vLLM took for these greedy requests (cold prefix cache), and its tokens."""
        assert self._proc.stdin is not None
        command = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens}
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        answer = self._read()
        return answer["seconds"], answer["outputs"]

    def close(self) -> None:
        if self._proc.poll() is None and self._proc.stdin is not None:
            self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self._proc.stdin.close()
        self._proc.wait(timeout=60)
        self._log.close()
        self._settings.unlink(missing_ok=True)


def token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, int]:
    """Greedy agreement per request: tokens equal up to the first difference (after one,
    the two continue from different contexts, so later matches mean nothing)."""
    equal = identical = 0
    for a, b in zip(ours, theirs, strict=True):
        pairs = enumerate(zip(a, b, strict=False))
        prefix = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
        equal += prefix
        identical += a == b
    return {
        "equal_tokens": equal,
        "tokens": sum(map(len, ours)),
        "identical_requests": identical,
        "requests": len(ours),
    }
