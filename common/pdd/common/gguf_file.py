"""A GGUF file read as a Hugging Face checkpoint: config, tokenizer, chat template, tensors.

llama.cpp and Ollama users hold their models as single GGUF files. Everything the
workers and the router need is inside one: the architecture's hyper-parameters as
``{arch}.*`` metadata, the tokenizer's vocabulary and merges, the chat template, and
the (usually quantized) tensors. This module translates each into what a transformers
checkpoint directory would hold, so the rest of the system sees one kind of checkpoint:

- ``hf_config()``: a config.json dict;
- ``tokenizer()``: a ``tokenizers.Tokenizer`` built from the vocabulary and merges;
- ``tensor(name)``: a tensor under its transformers name, dequantized to float32 with
  llama.cpp's rotary permutation of Llama's q/k projections undone.

Torch-free (numpy and the ``gguf`` package only): the router reads the tokenizer and
template of a GGUF model too. The file is read by ``pdd.common.gguf_reader``, which
checks every count and size in its header against the file's length first.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from pdd.common.gguf_reader import GGUFError, read_gguf

#: GGUF architecture name -> transformers architecture (what the engine runs).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: Tensor types the loader dequantizes (the ones tested; others are refused by name).
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q4_K", "Q5_K", "Q6_K")  # fmt: skip

# GGUF tensor name -> transformers name ("{i}": the layer index).
GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")

# The pre-tokenizer regexes llama.cpp names in ``tokenizer.ggml.pre`` (the same splits
# the models' own tokenizer.json files make).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: ``tokenizer.ggml.pre`` -> (split regex, digits split one by one first); no regex: the
#: byte-level pre-tokenizer's own (GPT-2's) split.
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False),
    "gpt-2": (None, False),
    "smollm": (None, True),
    "starcoder": (None, True),
    "refact": (None, True),
    "llama-bpe": (_LLAMA3_REGEX, False),
    "llama3": (_LLAMA3_REGEX, False),
    "qwen2": (_QWEN2_REGEX, False),
    "qwen35": (_QWEN2_REGEX, False),
    "deepseek-r1-qwen": (_QWEN2_REGEX, False),
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class GGUFModelFile:
    """One GGUF model file, read lazily (the tensors are memory-mapped)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path} does not exist or is not a file")
        self._reader = read_gguf(self.path)
        self.gguf_arch = str(self._field("general.architecture", ""))
        if self.gguf_arch not in ARCHITECTURES:
            raise GGUFError(
                f"{self.path.name}: GGUF architecture {self.gguf_arch!r} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )

    # -- metadata ---------------------------------------------------------------------

    def _field(self, key: str, default: Any = None) -> Any:
        value = self._reader.fields.get(key, default)
        return value.tolist() if isinstance(value, np.ndarray) else value

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.gguf_arch}.{key}", default)

    def _arch_int(self, key: str, default: int | None = None) -> int:
        """A hyper-parameter that must be a positive integer: a missing or absurd one is a
        GGUFError naming the key, not a TypeError deep in the engine."""
        value = self._arch_field(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GGUFError(
                f"{self.path.name}: metadata key '{self.gguf_arch}.{key}' must be a positive "
                f"integer, not {value!r}"
            )
        return value

    def _tokens(self) -> list[str]:
        """``tokenizer.ggml.tokens`` (empty where absent), checked to be strings."""
        tokens = self._field("tokenizer.ggml.tokens", [])
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise GGUFError(f"{self.path.name}: tokenizer.ggml.tokens is not a list of strings")
        return tokens

    def _layer_count(self) -> int:
        """``block_count``, held to the layers the tensors name: a header claiming more
        layers than the file has would have the engine build every one of them."""
        layers = self._arch_int("block_count")
        named = {int(m.group(1)) for m in map(_LAYER_NAME.match, self._tensors) if m}
        if len(named) != layers or max(named, default=-1) != layers - 1:  # 0..layers-1
            raise GGUFError(
                f"{self.path.name}: metadata says {layers} layers ({self.gguf_arch}.block_count) "
                f"but the file's tensors are of {len(named)} layers"
            )
        return layers

    @cached_property
    def _tensors(self) -> dict[str, Any]:
        return {t.name: t for t in self._reader.tensors}

    def hf_config(self) -> dict[str, Any]:
        """The config.json a transformers export of this model would carry."""
        heads = self._arch_int("attention.head_count")
        hidden = self._arch_int("embedding_length")
        tokens = self._tokens()
        if "rope_freqs.weight" in self._tensors:
            raise GGUFError(
                f"{self.path.name}: per-frequency RoPE factors (rope_freqs, Llama 3.1+) are "
                "not supported from GGUF; use the model's safetensors checkpoint"
            )
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.gguf_arch]],
            "model_type": self.gguf_arch,
            "vocab_size": int(self._arch_field("vocab_size", 0) or len(tokens)),
            "hidden_size": hidden,
            "intermediate_size": self._arch_int("feed_forward_length"),
            "num_hidden_layers": self._layer_count(),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch_int("attention.head_count_kv", heads),
            "head_dim": self._arch_int("attention.key_length", max(1, hidden // heads)),
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": self._arch_int("context_length"),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
        }
        scaling = self._rope_scaling()
        if scaling is not None:
            config["rope_scaling"] = scaling
        if self.gguf_arch == "llama":
            config["attention_bias"] = "blk.0.attn_q.bias" in self._tensors
        return config

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        scaling: dict[str, Any] = {
            "rope_type": kind,
            "factor": float(self._arch_field("rope.scaling.factor", 1.0)),
        }
        original = self._arch_field("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template the file carries (``tokenizer.chat_template``)."""
        template = self._field("tokenizer.chat_template")
        return str(template) if template else None

    def special_tokens(self) -> dict[str, str]:
        """bos/eos/unk/pad token strings, as tokenizer_config.json names them."""
        tokens = self._tokens()
        out = {}
        for name in ("bos", "eos", "unknown", "padding"):
            token_id = self._field(f"tokenizer.ggml.{name}_token_id")
            if token_id is not None and 0 <= token_id < len(tokens):
                key = {"unknown": "unk", "padding": "pad"}.get(name, name)
                out[f"{key}_token"] = str(tokens[token_id])
        return out

    def tokenizer_config(self) -> dict[str, Any]:
        """A tokenizer_config.json: special tokens and the chat template."""
        config: dict[str, Any] = dict(self.special_tokens())
        config["add_bos_token"] = bool(self._field("tokenizer.ggml.add_bos_token", False))
        if self.chat_template:
            config["chat_template"] = self.chat_template
        return config

    def tokenizer(self) -> Any:
        """A ``tokenizers.Tokenizer`` equal to the model's byte-level BPE tokenizer."""
        from tokenizers import (
            AddedToken,
            Regex,
            Tokenizer,
            decoders,
            models,
            pre_tokenizers,
            processors,
        )

        kind = self._field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(
                f"{self.path.name}: tokenizer model {kind!r} is not supported from GGUF (only "
                "byte-level BPE, 'gpt2'); use the model's tokenizer.json checkpoint"
            )
        pre = str(self._field("tokenizer.ggml.pre", "default"))
        if pre not in _PRE_TOKENIZERS:
            raise GGUFError(
                f"{self.path.name}: pre-tokenizer {pre!r} is not known; known: "
                f"{', '.join(_PRE_TOKENIZERS)}"
            )
        tokens = self._tokens()
        if not tokens:
            raise GGUFError(f"{self.path.name}: the file has no vocabulary (tokenizer.ggml.tokens)")
        pairs = (str(m).partition(" ") for m in self._field("tokenizer.ggml.merges") or [])
        merges = [(left, right) for left, _, right in pairs]
        tok = Tokenizer(
            models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                       fuse_unk=False, byte_fallback=False)
        )  # fmt: skip
        regex, split_digits = _PRE_TOKENIZERS[pre]
        steps: list[Any] = []
        if split_digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if regex is not None:
            steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
        types = self._field("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise GGUFError(f"{self.path.name}: {len(types)} token types for {len(tokens)} tokens")
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, kind in enumerate(types) if kind == _CONTROL]  # fmt: skip
        added = [AddedToken(tokens[i], special=False, normalized=False)
                 for i, kind in enumerate(types) if kind == _USER_DEFINED]  # fmt: skip
        tok.add_special_tokens(special)
        tok.add_tokens(added)
        bos = self._field("tokenizer.ggml.bos_token_id")
        if bos is not None and not (isinstance(bos, int) and 0 <= bos < len(tokens)):
            raise GGUFError(f"{self.path.name}: bos_token_id {bos!r} is not a token's id")
        if self._field("tokenizer.ggml.add_bos_token", False) and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)],
            )  # fmt: skip
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        return tok

    # -- tensors ----------------------------------------------------------------------

    def tensor_names(self) -> Iterator[str]:
        """The transformers names of every tensor in the file."""
        for name in self._tensors:
            yield self.hf_name(name)

    def hf_name(self, gguf_name: str) -> str:
        if gguf_name in GLOBAL_TENSOR_NAMES:
            return GLOBAL_TENSOR_NAMES[gguf_name]
        match = _LAYER_NAME.match(gguf_name)
        if match is None or match.group(2) not in LAYER_TENSOR_NAMES:
            raise GGUFError(f"{self.path.name}: tensor {gguf_name!r} has no transformers name")
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{LAYER_TENSOR_NAMES[part]}.{kind}"

    @cached_property
    def _by_hf_name(self) -> dict[str, str]:
        return {self.hf_name(name): name for name in self._tensors}

    def tensor_type(self, hf_name: str) -> str:
        return str(self._tensors[self._by_hf_name[hf_name]].tensor_type.name)

    def tensor(self, hf_name: str) -> np.ndarray:
        """The tensor, dequantized to float32 in transformers' layout; KeyError if absent."""
        from gguf import quants

        raw = self._tensors[self._by_hf_name[hf_name]]
        kind = raw.tensor_type.name
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(
                f"{self.path.name}: tensor {raw.name} is {kind}; supported tensor types: "
                f"{', '.join(SUPPORTED_TENSOR_TYPES)}"
            )
        shape = tuple(int(n) for n in reversed(raw.shape))
        values = np.array(quants.dequantize(raw.data, raw.tensor_type), dtype=np.float32)
        values = values.reshape(shape)
        if self.gguf_arch == "llama" and raw.name.split(".")[-2] in ("attn_q", "attn_k"):
            values = self._unpermute(values, raw.name.split(".")[-2] == "attn_k")
        return values

    def _unpermute(self, values: np.ndarray, is_key: bool) -> np.ndarray:
        """Undo llama.cpp's converter, which interleaves each head's rotary halves of the
        q and k projections (rows, and biases alike)."""
        heads = int(self._arch_field("attention.head_count"))
        if is_key:
            heads = int(self._arch_field("attention.head_count_kv", heads))
        half = values.shape[0] // heads // 2
        return np.ascontiguousarray(
            values.reshape(heads, half, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
        )

    def parameter_count(self) -> int:
        return sum(int(np.prod([int(n) for n in t.shape])) for t in self._reader.tensors)

    def quantization(self) -> str:
        """The dominant tensor type, e.g. ``Q4_1`` (what llama.cpp calls the file type)."""
        counts: dict[str, int] = {}
        for t in self._reader.tensors:
            n = int(np.prod([int(d) for d in t.shape]))
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + n
        return max(counts, key=lambda k: counts[k]) if counts else "F32"


def gguf_checkpoint(path: str | Path) -> Path | None:
    """The GGUF file ``path`` stands for: itself, or the one .gguf of a directory without
    config.json (a GGUF-only Hub repo as pulled); None for anything else."""
    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists():
        files = sorted(p.glob("*.gguf"))
        return files[0] if len(files) == 1 and is_gguf(files[0]) else None
    return p if is_gguf(p) else None


def is_gguf(path: str | Path) -> bool:
    """A GGUF file by name and magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"
