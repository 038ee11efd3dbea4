"""Small GGUF files written in a test's own process with the ``gguf`` package's writer.

Tests never download a model: they write a transformers checkpoint's tensors (or
random ones) into a GGUF file as llama.cpp's converter lays them out (tensor names,
the rotary permutation of Llama's q/k rows, quantized blocks), with a byte-level BPE
tokenizer and a chat template in the metadata. ``raw_gguf`` and its helpers write a file
byte by byte, counts and lengths as the test says, for the readers' checks on damaged and
hostile headers.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants
from tokenizers import Tokenizer

from pdd.common.gguf_file import GLOBAL_TENSOR_NAMES, LAYER_TENSOR_NAMES

#: Types whose blocks the ``gguf`` package cannot quantize: their bytes are drawn at
#: random (with small scales), so the weights are whatever those blocks dequantize to.
RANDOM_BLOCK_TYPES = ("Q4_K", "Q6_K")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_gguf(
    out: Path,
    arch: str,
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    tokenizer: Tokenizer,
    matrix_type: str = "F32",
    chat_template: str | None = CHAT_TEMPLATE,
    seed: int = 0,
) -> Path:
    """Write ``tensors`` (transformers names, float32) of a ``config`` (config.json dict)
    as a GGUF file; 2-D weights but the embedding's take ``matrix_type`` (the embedding
    Q8_0 where that is quantized, as llama.cpp does), norms and biases stay F32."""
    writer = GGUFWriter(str(out), arch)
    _write_hparams(writer, arch, config)
    _write_tokenizer(writer, tokenizer, config, chat_template)
    gguf_names = _gguf_names()
    rng = np.random.default_rng(seed)
    for name, value in tensors.items():
        value = np.asarray(value, dtype=np.float32)
        part = name.rsplit(".", 2)[-2]
        if arch == "llama" and part in ("q_proj", "k_proj"):
            heads = config["num_attention_heads"]
            if part == "k_proj":
                heads = config.get("num_key_value_heads") or heads
            value = _permute(value, heads)
        kind = matrix_type if value.ndim == 2 else "F32"
        if name == "model.embed_tokens.weight" and kind not in ("F32", "F16", "BF16"):
            kind = "Q8_0"
        _add(writer, _gguf_name(name, gguf_names), value, kind, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_hparams(writer: GGUFWriter, arch: str, c: Mapping[str, Any]) -> None:
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(c.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(c["vocab_size"])


def _write_tokenizer(
    writer: GGUFWriter, tok: Tokenizer, c: Mapping[str, Any], chat_template: str | None
) -> None:
    import json

    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_token_merges(merges)
    if c.get("bos_token_id") is not None:
        writer.add_bos_token_id(c["bos_token_id"])
        writer.add_add_bos_token(True)
    eos = c.get("eos_token_id")
    if eos is not None:
        writer.add_eos_token_id(eos if isinstance(eos, int) else eos[0])
    if chat_template:
        writer.add_chat_template(chat_template)


def _gguf_names() -> dict[str, str]:
    names = {hf: gguf for gguf, hf in GLOBAL_TENSOR_NAMES.items()}
    names.update({hf: gguf for gguf, hf in LAYER_TENSOR_NAMES.items()})
    return names


def _gguf_name(hf_name: str, names: Mapping[str, str]) -> str:
    if hf_name in names:
        return names[hf_name]
    # model.layers.{i}.{part}.{weight|bias}
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{names[part]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _add(writer: GGUFWriter, name: str, value: np.ndarray, kind: str, rng: Any) -> None:
    qtype = GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor(name, value)
    elif kind == "F16":
        writer.add_tensor(name, value.astype(np.float16))
    elif kind in RANDOM_BLOCK_TYPES:
        writer.add_tensor(name, _random_blocks(value.shape, qtype, rng), raw_dtype=qtype)
    else:
        writer.add_tensor(name, quants.quantize(value, qtype), raw_dtype=qtype)


def _random_blocks(shape: tuple[int, ...], qtype: GGMLQuantizationType, rng: Any) -> np.ndarray:
    """Random K-quant blocks whose f16 super-block scales are small and finite."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values")
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-4 if qtype.name == "Q6_K" else 2e-3).tobytes(), np.uint8)
    if qtype.name == "Q4_K":  # d, dmin lead the block
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    else:  # Q6_K: d ends it
        blocks[..., size - 2 : size] = scale
    return blocks.reshape(rows, -1)


# -- hostile files, byte by byte --------------------------------------------------------
# GGUF value types and tensor types these builders use (the GGUF specification's numbers).
UINT8, UINT32, STRING, ARRAY = 0, 4, 8, 9
F32 = 0


def raw_gguf(
    metadata: Sequence[bytes] = (),
    tensors: Sequence[bytes] = (),
    kv_count: int | None = None,
    tensor_count: int | None = None,
    tail: bytes = b"",
) -> bytes:
    """A GGUF file's bytes, its counts as given (the entries' own counts by default):
    what a damaged or hostile file holds, for tests of the readers' checks."""
    counts = struct.pack(
        "<QQ",
        len(tensors) if tensor_count is None else tensor_count,
        len(metadata) if kv_count is None else kv_count,
    )
    return b"GGUF" + struct.pack("<I", 3) + counts + b"".join(metadata) + b"".join(tensors) + tail


def gguf_string(text: str, length: int | None = None) -> bytes:
    """A GGUF string: its length (as given, else the true one), then its bytes."""
    data = text.encode()
    return struct.pack("<Q", len(data) if length is None else length) + data


def gguf_kv(key: str, value_type: int, value: bytes) -> bytes:
    """A metadata entry: key, value type, the value's bytes as given."""
    return gguf_string(key) + struct.pack("<I", value_type) + value


def gguf_array(item_type: int, count: int, items: bytes = b"") -> bytes:
    """An array value: item type, element count (as given), the elements' bytes."""
    return struct.pack("<IQ", item_type, count) + items


def gguf_tensor_info(name: str, shape: Sequence[int], tensor_type: int, offset: int) -> bytes:
    """A tensor's header entry; ``shape`` in GGUF order (the row length first)."""
    dims = struct.pack(f"<I{len(shape)}Q", len(shape), *shape)
    return gguf_string(name) + dims + struct.pack("<IQ", tensor_type, offset)
