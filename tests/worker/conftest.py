"""Shared worker-test fixtures: tiny models and checkpoints, the leak check, few torch threads."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdd.worker.engine import Engine
from pdd.worker.engine.request import RequestOutput
from pdd.worker.model import cpu_kernels
from pdd.worker.model.loader import LoadedModel, load_model

# Loaded by path: with --import-mode=importlib the tests folder is not on sys.path.
_spec = importlib.util.spec_from_file_location(
    "pdd_test_checkpoints", Path(__file__).with_name("checkpoints.py")
)
checkpoints = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checkpoints)
write_hf_checkpoint = checkpoints.write_hf_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernels_loaded() -> None:
    """Load (or build) the CPU kernels before any unit test's process guard, so whether
    the engine uses them never depends on which test loads a model first."""
    cpu_kernels.load()


@pytest.fixture(scope="session", autouse=True)
def _few_torch_threads() -> None:
    """The test machine has two cores shared by parallel suites."""
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``hf_checkpoint("qwen2", tie_word_embeddings=True) -> Path``.

    Same arguments as ``checkpoints.write_hf_checkpoint`` minus the directory. Each
    checkpoint is written once per session (transformers builds and saves the model)
    and every call gets its own copy, which the test may break as it likes.
    """
    written: dict[str, Path] = {}

    def make(arch: str, **kwargs: object) -> Path:
        key = f"{arch}:{sorted(kwargs.items())!r}"
        if key not in written:
            written[key] = write_hf_checkpoint(tmp_path_factory.mktemp(arch), arch, **kwargs)
        return Path(shutil.copytree(written[key], tmp_path_factory.mktemp(arch) / "ckpt"))

    return make


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: ``trained_checkpoint("llama") -> Path``, a checkpoint trained on the
    synthetic corpus (``checkpoints.train_hf_checkpoint``), trained once per session
    (about a minute of CPU each: slow-tier tests only). Tests must not modify it."""
    trained: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in trained:
            trained[arch] = checkpoints.train_hf_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return trained[arch]

    return make


@pytest.fixture(scope="session")
def corpus_prompts() -> list[list[int]]:
    """Four prompts of 60-120 tokens from the corpus the trained checkpoints learned."""
    return checkpoints.corpus_prompts(checkpoints.BASE_CONFIG["vocab_size"], 4)


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """The built-in tiny model, loaded once (engines may share a ``LoadedModel``)."""
    return load_model("tiny")


def _assert_no_leaks(engine: Engine) -> None:
    """Every block back in the pool once the prefix cache is emptied; no lock left."""
    engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.stats.num_locked_blocks == 0
    engine.reset_prefix_cache()
    stats = engine.stats
    assert stats.num_cached_blocks == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def _drain(engine: Engine) -> list[RequestOutput]:
    """Step ``engine`` until it has no work; every output, in order."""
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


@pytest.fixture(scope="session")
def drain() -> Callable[[Engine], list[RequestOutput]]:
    """``drain(engine)``: step it until it has no work; every output, in order."""
    return _drain


@pytest.fixture(scope="session")
def assert_no_leaks() -> Callable[[Engine], None]:
    """``assert_no_leaks(engine)``: the end-of-test check that nothing leaked."""
    return _assert_no_leaks
