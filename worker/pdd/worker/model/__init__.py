"""Llama-family decoder (Llama, Qwen2, Qwen3) over a paged KV cache, and its loader."""

from pdd.worker.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, tiny_config
from pdd.worker.model.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ModelLoadError,
    UnsupportedArchitectureError,
)
from pdd.worker.model.llama import LlamaForCausalLM
from pdd.worker.model.loader import LoadedModel, load_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "UnsupportedArchitectureError",
    "load_model",
    "tiny_config",
]
