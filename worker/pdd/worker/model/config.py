"""The model's shape, read from a Hugging Face config.json or the built-in tiny preset.

One frozen dataclass feeds the model builder, the KV cache layout and the KV export
header, so the three cannot disagree about head counts or dtypes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from pdd.worker.model.errors import CorruptCheckpointError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    """Everything that shapes the decoder; derived values are properties or methods.

    ``rope_scaling`` is the normalised scaling dict (always with ``rope_type``) or None
    for plain RoPE; it is excluded from hashing so the config stays usable as a key.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str  # the checkpoint's own dtype: the default compute dtype
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj
    mlp_bias: bool = False
    name: str = ""  # checkpoint name, part of the fingerprint

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers (sizes pools and links)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def fingerprint(self) -> str:
        """Stable short hash of what makes two instances' KV interchangeable.

        KV imported from another instance is only valid when both run the same
        weights with the same attention shape and positional encoding; the name stands
        in for the weights, which are too big to hash at every start.
        """
        keys = {
            "name", "architecture", "vocab_size", "hidden_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "max_position_embeddings",
            "qk_norm", "attention_bias",
        }  # fmt: skip
        data = {k: v for k, v in asdict(self).items() if k in keys}
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> ModelConfig:
        """Read a transformers 4 or 5 config.json dict; reject what we cannot run."""
        arch = _architecture(d)
        _reject_unsupported_features(d)
        heads = _required(d, "num_attention_heads")
        hidden = _required(d, "hidden_size")
        rope_theta, rope_scaling = _rope(d)
        bias = arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=_required(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(d, "intermediate_size"),
            num_layers=_required(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_required(d, "max_position_embeddings"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=_id_tuple(d.get("eos_token_id")),
            bos_token_id=d.get("bos_token_id"),
            torch_dtype=_dtype_name(d),
            o_proj_bias=arch != "Qwen2ForCausalLM" and bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            name=name or d.get("_name_or_path", "") or "",
        )


# Byte-level vocabulary of the tiny preset: 256 bytes, then the special tokens.
TINY_BOS_ID = 256
TINY_EOS_ID = 257
TINY_PAD_ID = 258


def tiny_config() -> ModelConfig:
    """The built-in ``tiny`` preset: big enough to exercise GQA and paging, fast on CPU."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=259,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        eos_token_ids=(TINY_EOS_ID,),
        bos_token_id=TINY_BOS_ID,
        torch_dtype="float32",
        name="tiny",
    )


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(d.get("model_type", ""), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        found = arch or f"model_type {d.get('model_type')!r}"
        raise UnsupportedArchitectureError(
            f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _reject_unsupported_features(d: dict[str, Any]) -> None:
    """Refuse configs that would load but compute something else than the checkpoint."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported; only 'silu'")
    if d.get("use_sliding_window"):
        raise UnsupportedArchitectureError(
            "sliding-window attention is not supported; set use_sliding_window to false "
            "(exact for prompts shorter than sliding_window)"
        )


def _required(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise CorruptCheckpointError(f"config.json lacks {key!r}; re-export the checkpoint")
    return d[key]


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Normalise transformers 5 ``rope_parameters`` and 4 ``rope_theta``/``rope_scaling``."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedArchitectureError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def _id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _dtype_name(d: dict[str, Any]) -> str:
    name = d.get("dtype") or d.get("torch_dtype") or "float32"
    if name not in SUPPORTED_DTYPES:
        raise CorruptCheckpointError(
            f"config.json dtype {name!r} is not one of {', '.join(SUPPORTED_DTYPES)}"
        )
    return name
