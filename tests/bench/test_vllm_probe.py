"""The vLLM probe against a real interpreter without vLLM: the bench's skip reason."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).parents[2] / "bench"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_an_interpreter_without_vllm_is_a_skip_with_its_import_error():
    sys.path.insert(0, str(BENCH))
    try:
        import vllm_baseline
    finally:
        sys.path.remove(str(BENCH))
    with pytest.raises(vllm_baseline.VllmUnavailableError, match=r"cannot import vllm: .*vllm"):
        vllm_baseline.probe(sys.executable)
