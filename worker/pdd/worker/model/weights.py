"""Reading a checkpoint's safetensors into the model, and the tiny preset's random init.

The model is built on the meta device and receives its tensors by ``assign``, so
loading neither runs a throwaway random init nor holds two copies of the weights.
Every failure names the file and the tensor, since "the checkpoint is broken" alone
sends the operator hunting.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pdd.common.gguf_file import GGUFError, GGUFModelFile
from pdd.worker.model.errors import CheckpointNotFoundError, CorruptCheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Our fused parameters and the checkpoint tensors they concatenate (along dim 0).
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class SafetensorsCheckpoint:
    """Tensor name -> file map of a single-file or sharded (index.json) checkpoint."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files = self._tensor_files()
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def get(self, name: str) -> torch.Tensor:
        """One tensor as stored (on the CPU); raises naming the file on any damage."""
        path = self.files.get(name)
        if path is None:
            raise CorruptCheckpointError(
                f"tensor {name!r} is missing from the checkpoint in {self.directory}; "
                "it does not match config.json (wrong architecture or a partial export)"
            )
        try:
            return self._handle(path).get_tensor(name)
        except SafetensorError as e:
            raise _damaged(path, e) from e

    def _handle(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointNotFoundError(
                    f"shard {path} listed in {INDEX_FILE} does not exist; copy the complete "
                    "checkpoint directory"
                )
            try:
                self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
            except SafetensorError as e:
                raise _damaged(path, e) from e
        return self._handles[path]

    def _tensor_files(self) -> dict[str, Path]:
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CorruptCheckpointError(
                    f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}"
                ) from e
            return {name: self.directory / file for name, file in weight_map.items()}
        if single.is_file():
            try:
                with safe_open(single, framework="pt") as f:
                    return dict.fromkeys(f.keys(), single)
            except SafetensorError as e:
                raise _damaged(single, e) from e
        raise CheckpointNotFoundError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {self.directory}; only safetensors weights "
            "are supported (convert .bin weights with transformers' save_pretrained)"
        )


class GGUFCheckpoint:
    """A GGUF file's tensors under their transformers names (dequantized to float32 as
    they are asked for, so only one layer's float copy exists besides the model's)."""

    def __init__(self, gguf: GGUFModelFile) -> None:
        self.gguf = gguf
        self.directory = gguf.path

    def get(self, name: str) -> torch.Tensor:
        try:
            return torch.from_numpy(self.gguf.tensor(name))
        except KeyError:
            raise CorruptCheckpointError(
                f"tensor {name!r} is missing from {self.gguf.path}; the file's metadata and "
                "tensors disagree (a partial or foreign conversion)"
            ) from None
        except GGUFError as e:
            raise CorruptCheckpointError(str(e)) from e


def load_checkpoint_weights(
    model: nn.Module,
    ckpt: SafetensorsCheckpoint | GGUFCheckpoint,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Fill every parameter of a meta-device ``model`` from the checkpoint."""
    state = {}
    for name, param in model.state_dict().items():
        tensor = _checkpoint_tensor(ckpt, name)
        if tensor.shape != param.shape:
            raise CorruptCheckpointError(
                f"tensor {name!r} in {ckpt.directory} has shape {tuple(tensor.shape)} but "
                f"config.json implies {tuple(param.shape)}; config.json and the weights "
                "come from different models"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
    _assign(model, state)


def init_random_weights(
    model: nn.Module, seed: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Deterministic weights for the tiny preset: the same on every machine and device.

    Drawn on the CPU from one seeded generator in parameter order, scaled like a
    trained model (unit embeddings, 1/sqrt(fan_in) matrices) so logits are peaked
    enough for greedy decoding to be stable, then moved to ``device``.
    """
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in model.state_dict().items():
        if name.endswith("norm.weight"):
            t = torch.ones(param.shape)
        elif name.endswith(".bias"):
            t = torch.zeros(param.shape)
        else:
            std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(param.shape[-1])
            t = torch.randn(param.shape, generator=gen) * std
        state[name] = t.to(device=device, dtype=dtype)
    _assign(model, state)


def _checkpoint_tensor(ckpt: SafetensorsCheckpoint | GGUFCheckpoint, name: str) -> torch.Tensor:
    for fused, parts in _FUSED.items():
        if f".{fused}." in name:
            return torch.cat([ckpt.get(name.replace(fused, part)) for part in parts], dim=0)
    return ckpt.get(name)


def _assign(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()


def _damaged(path: Path, err: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} is damaged or incomplete ({err}); copy or download it again"
    )
