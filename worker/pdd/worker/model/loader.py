"""``load_model``: a Hugging Face checkpoint directory, a GGUF file, or the built-in ``tiny``.

The one entry point the worker calls at startup; it returns the model, its config
and tokenizer together so nothing else reads checkpoint files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdd.common.gguf_file import GGUFError, GGUFModelFile, gguf_checkpoint
from pdd.common.model_store import ModelNotPulledError, resolve_model
from pdd.common.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from pdd.worker.model.config import ModelConfig, tiny_config
from pdd.worker.model.cpu_kernels import kernels_for
from pdd.worker.model.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ModelLoadError,
    TokenizerMissingError,
)
from pdd.worker.model.kv_cache import KVLayout
from pdd.worker.model.layers import pack_dtype
from pdd.worker.model.llama import LlamaForCausalLM
from pdd.worker.model.weights import (
    GGUFCheckpoint,
    SafetensorsCheckpoint,
    init_random_weights,
    load_checkpoint_weights,
)

TINY = "tiny"
TINY_SEED = 0

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    """A ready model: weights on ``device`` in ``dtype``, with its config and tokenizer."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device

    def kv_layout(self, block_size: int) -> KVLayout:
        """The cache layout this model writes (its dtype is the model's)."""
        return KVLayout.from_config(self.config, block_size, self.dtype)


def load_model(
    source: str,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    require_tokenizer: bool = True,
) -> LoadedModel:
    """Load ``tiny`` (seeded random weights, byte tokenizer), a checkpoint directory or a
    GGUF file (dequantized into ``dtype``; float32 unless asked otherwise).

    dtype None means the checkpoint's own dtype, except float16 on the CPU, which
    becomes float32 (CPU fp16 kernels are slow or missing; bf16 is the fast choice).
    ``require_tokenizer=False`` loads a checkpoint without ``tokenizer.json`` too, for a
    caller that only passes token IDs: its tokenizer is an ``IdsOnlyTokenizer``.
    """
    device = torch.device(device)
    try:
        source = resolve_model(source)  # a pulled built-in or Hub name: its folder
    except ModelNotPulledError as e:
        raise CheckpointNotFoundError(str(e)) from e
    if source == TINY:
        config = tiny_config()
        torch_dtype = resolve_dtype(dtype, config, device)
        model = _empty_model(config, device)
        init_random_weights(model, TINY_SEED, torch_dtype, device)
        _prepare_for_device(model, torch_dtype, device)
        return LoadedModel(model, config, ByteTokenizer(), torch_dtype, device)
    gguf_file = gguf_checkpoint(source)
    if gguf_file is not None:
        return _load_gguf(gguf_file, dtype, device)
    directory = Path(source)
    if not directory.is_dir():
        raise CheckpointNotFoundError(
            f"model {source!r} is neither {TINY!r}, a checkpoint directory nor a GGUF file "
            "(`pdd models pull NAME` fetches one; `pdd models list` names the built-ins)"
        )
    config = ModelConfig.from_hf_dict(_read_config(directory), name=directory.name)
    torch_dtype = resolve_dtype(dtype, config, device)
    if require_tokenizer or (directory / "tokenizer.json").exists():
        tokenizer: Tokenizer = _hf_tokenizer(directory, config)
    else:
        tokenizer = IdsOnlyTokenizer(_eos_ids(directory, config), config.vocab_size)
    model = _empty_model(config, device)
    with SafetensorsCheckpoint(directory) as ckpt:
        load_checkpoint_weights(model, ckpt, torch_dtype, device)
    _prepare_for_device(model, torch_dtype, device)
    return LoadedModel(model, config, tokenizer, torch_dtype, device)


def _load_gguf(path: Path, dtype: str | torch.dtype | None, device: torch.device) -> LoadedModel:
    """A GGUF file: config, tokenizer and chat template from its metadata, tensors
    dequantized (``pdd.common.gguf_file`` translates names and layouts)."""
    try:
        gguf = GGUFModelFile(path)
        config = ModelConfig.from_hf_dict(gguf.hf_config(), name=path.stem)
        tokenizer = HFTokenizer.from_tokenizer(gguf.tokenizer(), config.eos_token_ids)
    except GGUFError as e:
        raise CorruptCheckpointError(str(e)) from e
    torch_dtype = resolve_dtype(dtype, config, device)
    model = _empty_model(config, device)
    load_checkpoint_weights(model, GGUFCheckpoint(gguf), torch_dtype, device)
    _prepare_for_device(model, torch_dtype, device)
    return LoadedModel(model, config, tokenizer, torch_dtype, device)


def _prepare_for_device(model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Prepack the projections where that pays (fp32 and bf16 on the CPU: the weights'
    memory is then held twice, plain and packed; bf16 without native bf16 packs as fp32,
    see ``layers.pack_dtype``) and pick the compiled CPU kernels."""
    compute_dtype = pack_dtype(device, dtype)
    if compute_dtype is not None:
        model.pack_weights(compute_dtype)
    model.kernels = kernels_for(device, dtype, model.config.head_dim)


class IdsOnlyTokenizer:
    """The tokenizer of a checkpoint without ``tokenizer.json``, for token-ID callers:
    the engine asks it only for the IDs that end a generation (config.json's and
    generation_config.json's); encoding or decoding text is a ``TokenizerMissingError``."""

    def __init__(self, eos_token_ids: Sequence[int], vocab_size: int) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        raise TokenizerMissingError("this checkpoint has no tokenizer.json; pass token IDs")

    def decode(self, ids: Sequence[int]) -> str:
        raise TokenizerMissingError("this checkpoint has no tokenizer.json to decode with")


def resolve_dtype(
    requested: str | torch.dtype | None, config: ModelConfig, device: torch.device
) -> torch.dtype:
    """The compute dtype: the requested one, else the checkpoint's (see load_model)."""
    if isinstance(requested, torch.dtype):
        if requested not in _DTYPES.values():
            raise ModelLoadError(f"dtype {requested} is not supported; use {_dtype_names()}")
        return requested
    name = requested or config.torch_dtype
    if name not in _DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not supported; use {_dtype_names()}")
    if requested is None and device.type == "cpu" and _DTYPES[name] == torch.float16:
        return torch.float32
    return _DTYPES[name]


def _empty_model(config: ModelConfig, device: torch.device) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(config, device)


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"{path} not found; a checkpoint directory needs the config.json that "
            "transformers' save_pretrained writes"
        )
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e}); restore the file") from e


def _hf_tokenizer(directory: Path, config: ModelConfig) -> HFTokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"{path} not found; save a fast tokenizer into the checkpoint "
            "(AutoTokenizer.from_pretrained(...).save_pretrained(dir))"
        )
    try:
        return HFTokenizer(path, _eos_ids(directory, config))
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise CorruptCheckpointError(f"{path} cannot be parsed ({e}); restore the file") from e


def _eos_ids(directory: Path, config: ModelConfig) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's (chat models list more there)."""
    ids = list(config.eos_token_ids)
    gen = directory / "generation_config.json"
    if gen.is_file():
        extra = json.loads(gen.read_text()).get("eos_token_id")
        for i in [extra] if isinstance(extra, int) else extra or []:
            if i not in ids:
                ids.append(i)
    return tuple(ids)


def _dtype_names() -> str:
    return ", ".join(_DTYPES)
