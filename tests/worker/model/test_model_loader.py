"""Loading checkpoints: dtype choice, tokenizer, and a clear typed error per failure."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdd.worker.model import (
    SUPPORTED_ARCHITECTURES,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ModelLoadError,
    UnsupportedArchitectureError,
    load_model,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def llama_dir(hf_checkpoint) -> Path:
    return hf_checkpoint("llama")


def edit_config(path: Path, **changes: object) -> None:
    cfg_path = path / "config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | changes))


def test_default_dtype_is_the_checkpoints_own(hf_checkpoint) -> None:
    path = hf_checkpoint("qwen3", dtype=torch.bfloat16)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_model(str(path))
    assert loaded.dtype == torch.bfloat16
    assert loaded.model.model.norm.weight.dtype == torch.bfloat16
    assert load_model(str(path), dtype=torch.float32).dtype == torch.float32


def test_fp16_checkpoint_defaults_to_fp32_on_cpu(hf_checkpoint) -> None:
    loaded = load_model(str(hf_checkpoint("llama", dtype=torch.float16)))
    assert loaded.dtype == torch.float32


def test_tokenizer_and_eos_come_with_the_model(llama_dir: Path) -> None:
    (llama_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    loaded = load_model(str(llama_dir))
    ids = loaded.tokenizer.encode("The quick brown fox")
    assert ids[0] == 0  # the BOS its post-processor adds
    assert loaded.tokenizer.decode(ids) == "The quick brown fox"
    assert loaded.tokenizer.eos_token_ids == (1, 7)
    assert loaded.config.name == llama_dir.name


def test_unsupported_architecture(llama_dir: Path) -> None:
    edit_config(llama_dir, architectures=["MistralForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(str(llama_dir))
    assert all(a in str(err.value) for a in SUPPORTED_ARCHITECTURES)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="neither 'tiny', an existing checkpoint"):
        load_model(str(tmp_path / "nope"))


def test_missing_config(llama_dir: Path) -> None:
    (llama_dir / "config.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"config\.json"):
        load_model(str(llama_dir))


def test_config_not_json(llama_dir: Path) -> None:
    (llama_dir / "config.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        load_model(str(llama_dir))


def test_missing_weights(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"model\.safetensors"):
        load_model(str(llama_dir))


def test_missing_tokenizer(llama_dir: Path) -> None:
    (llama_dir / "tokenizer.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"tokenizer\.json"):
        load_model(str(llama_dir))


def test_truncated_weights_name_the_file(llama_dir: Path) -> None:
    weights = llama_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError) as err:
        load_model(str(llama_dir))
    assert str(weights) in str(err.value) and "again" in str(err.value)


def test_missing_tensor_is_named(llama_dir: Path) -> None:
    weights = llama_dir / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(llama_dir))


def test_shape_mismatch_names_tensor_and_shapes(llama_dir: Path) -> None:
    edit_config(llama_dir, intermediate_size=96)
    with pytest.raises(CorruptCheckpointError, match=r"gate_up_proj.*shape \(256, 64\)"):
        load_model(str(llama_dir))


def test_missing_shard(hf_checkpoint) -> None:
    path = hf_checkpoint("llama", max_shard_size="40KB")
    victim = sorted(path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointNotFoundError, match=re.escape(victim.name)):
        load_model(str(path))


def test_unknown_dtype(llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="float64"):
        load_model(str(llama_dir), dtype="float64")
