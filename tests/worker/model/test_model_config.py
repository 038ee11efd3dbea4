"""Reading config.json in its transformers 4 and 5 shapes, and the derived values."""

from __future__ import annotations

import dataclasses

import pytest

from pdd.worker.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, tiny_config
from pdd.worker.model.errors import CorruptCheckpointError, UnsupportedArchitectureError

pytestmark = pytest.mark.unit

V4_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "eos_token_id": [128001, 128009],
    "bos_token_id": 128000,
    "torch_dtype": "bfloat16",
}


def test_transformers4_config_with_rope_scaling() -> None:
    cfg = ModelConfig.from_hf_dict(V4_LLAMA31)
    assert cfg.head_dim == 32  # derived: hidden / heads
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == (128001, 128009)
    assert cfg.torch_dtype == "bfloat16"
    assert not cfg.attention_bias and not cfg.qk_norm


def test_transformers5_rope_parameters_and_dtype() -> None:
    d = {k: v for k, v in V4_LLAMA31.items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    d["dtype"] = "float16"
    d["architectures"] = ["Qwen2ForCausalLM"]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    assert cfg.torch_dtype == "float16"
    assert cfg.attention_bias and not cfg.o_proj_bias  # Qwen2: q/k/v bias only


def test_architecture_inferred_from_model_type() -> None:
    d = {k: v for k, v in V4_LLAMA31.items() if k != "architectures"} | {"model_type": "qwen3"}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm


def test_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedArchitectureError) as err:
        ModelConfig.from_hf_dict(V4_LLAMA31 | {"architectures": ["GPT2LMHeadModel"]})
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(a in str(err.value) for a in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    "change",
    [
        {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
        {"hidden_act": "gelu"},
        {"use_sliding_window": True},
    ],
)
def test_unsupported_features_are_refused(change: dict) -> None:
    with pytest.raises(UnsupportedArchitectureError):
        ModelConfig.from_hf_dict(V4_LLAMA31 | change)


def test_missing_field_names_it() -> None:
    d = {k: v for k, v in V4_LLAMA31.items() if k != "intermediate_size"}
    with pytest.raises(CorruptCheckpointError, match="intermediate_size"):
        ModelConfig.from_hf_dict(d)


def test_kv_bytes_per_token() -> None:
    cfg = tiny_config()
    assert cfg.kv_bytes_per_token(2) == 2 * 4 * 2 * 32 * 2


def test_fingerprint_is_stable_and_tracks_kv_shape() -> None:
    cfg = tiny_config()
    assert cfg.fingerprint() == tiny_config().fingerprint()
    assert cfg.fingerprint() != dataclasses.replace(cfg, num_kv_heads=4).fingerprint()
    assert cfg.fingerprint() != dataclasses.replace(cfg, name="other").fingerprint()
    # Fields that do not shape the KV (e.g. stop tokens) leave it unchanged.
    assert cfg.fingerprint() == dataclasses.replace(cfg, eos_token_ids=(1,)).fingerprint()


def test_config_is_hashable_despite_rope_dict() -> None:
    cfg = ModelConfig.from_hf_dict(V4_LLAMA31)
    assert hash(cfg) == hash(ModelConfig.from_hf_dict(V4_LLAMA31))
