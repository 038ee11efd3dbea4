"""vLLM's engine arguments for PDD (pdd.worker.vllm.engine_args) and what an import may
claim of a KV store (pdd.worker.vllm.offline): plain data and files, no vLLM needed.

The slow tests start vLLM from these arguments; here, that they name the connector vLLM
must load (a typo would only show as a failed vLLM start), leave unset settings to vLLM,
and that an import claims exactly the exported prefix its prompt starts with.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from pdd.worker.engine.kv_transfer import encode_chunk
from pdd.worker.vllm.engine_args import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    PRIOR_PENALTIES_PROCESSOR,
    VllmEngineSettings,
    engine_kwargs,
)
from pdd.worker.vllm.offline import KVImportError, exported_prefix, import_transfer
from pdd.worker.vllm.params import import_params
from pdd.worker.vllm.store import DirectoryKVStore

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("module", "name"),
    [(CONNECTOR_MODULE, CONNECTOR_CLASS), tuple(PRIOR_PENALTIES_PROCESSOR.split(":"))],
)
def test_the_classes_named_for_vllm_to_load_exist(module: str, name: str) -> None:
    """Found without importing them (they import vLLM)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert name in classes


def test_unset_settings_are_vllms_and_the_store_turns_the_connector_on(tmp_path: Path) -> None:
    plain = engine_kwargs(VllmEngineSettings(model="/m", dtype="float32"))
    assert plain == {
        "model": "/m",
        "dtype": "float32",
        "tensor_parallel_size": 1,
        "kv_cache_dtype": "auto",
        "enforce_eager": False,
        "enable_prefix_caching": True,
        "logits_processors": [PRIOR_PENALTIES_PROCESSOR],
    }
    settings = VllmEngineSettings(
        model="/m", block_size=32, max_model_len=1024, max_num_seqs=4, seed=0,
        kv_cache_memory_bytes=1 << 30, enforce_eager=True, kv_store_dir=tmp_path,
    )  # fmt: skip
    kwargs = engine_kwargs(settings)
    assert {k: kwargs[k] for k in ("block_size", "max_model_len", "max_num_seqs", "seed")} == {
        "block_size": 32, "max_model_len": 1024, "max_num_seqs": 4, "seed": 0,
    }  # fmt: skip
    assert kwargs["kv_cache_memory_bytes"] == 1 << 30 and kwargs["enforce_eager"] is True
    assert "gpu_memory_utilization" not in kwargs
    assert kwargs["kv_transfer_config"] == {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store_dir": str(tmp_path)},
    }


def put_chunks(store: Path, key: str, prompt: list[int], bounds: list[tuple[int, int]]) -> None:
    for start, end in bounds:
        data = torch.zeros(2, 2, end - start, 1, 4)
        DirectoryKVStore(store).put(key, encode_chunk(data, start, "m", prompt[:end]))


def test_an_import_claims_the_exported_prefix_the_prompt_starts_with(tmp_path: Path) -> None:
    prompt = list(range(10, 30))
    put_chunks(tmp_path, "p", prompt, [(0, 8), (8, 20)])
    assert exported_prefix(tmp_path, "p")[0] == 20
    handed_over = [*prompt, 7, 8, 9]
    assert import_transfer(tmp_path, "p", handed_over) == import_params("p", 20)
    with pytest.raises(KVImportError, match="does not start with the 20 tokens"):
        import_transfer(tmp_path, "p", [*prompt[:-1], 99, 7])
    with pytest.raises(KVImportError, match="does not start with the 20 tokens"):
        import_transfer(tmp_path, "p", prompt[:12])
    with pytest.raises(KVImportError, match="no KV exported under 'q'"):
        import_transfer(tmp_path, "q", prompt)


def test_a_gap_ends_the_exported_prefix(tmp_path: Path) -> None:
    prompt = list(range(10, 40))
    put_chunks(tmp_path, "p", prompt, [(0, 8), (16, 30)])
    assert exported_prefix(tmp_path, "p")[0] == 8


def test_an_events_endpoint_turns_vllms_kv_events_on() -> None:
    """Off unless asked (``pdd generate`` and the connector's tests publish nothing);
    the vLLM worker asks, on a zmq socket vLLM binds."""
    assert "kv_events_config" not in engine_kwargs(VllmEngineSettings(model="/m"))
    settings = VllmEngineSettings(model="/m", kv_events_endpoint="ipc:///e", kv_events_topic="t")
    assert engine_kwargs(settings)["kv_events_config"] == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///e", "topic": "t",
    }  # fmt: skip
