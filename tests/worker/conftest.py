"""Shared worker-test fixtures: tiny HF checkpoints and low torch thread counts."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Loaded by path: with --import-mode=importlib the tests folder is not on sys.path.
_spec = importlib.util.spec_from_file_location(
    "pdd_test_checkpoints", Path(__file__).with_name("checkpoints.py")
)
checkpoints = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checkpoints)
write_hf_checkpoint = checkpoints.write_hf_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _few_torch_threads() -> None:
    """The test machine has two cores shared by parallel suites."""
    torch.set_num_threads(2)


@pytest.fixture
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``hf_checkpoint("qwen2", tie_word_embeddings=True) -> Path``.

    Same arguments as ``checkpoints.write_hf_checkpoint`` minus the directory; each
    call writes into a fresh temporary directory.
    """

    def make(arch: str, **kwargs: object) -> Path:
        return write_hf_checkpoint(tmp_path_factory.mktemp(arch), arch, **kwargs)

    return make
