"""GGUF files as checkpoints: ours against transformers' own GGUF loader, per tensor type.

Each case writes a transformers checkpoint's tensors into a GGUF file as llama.cpp
lays them out (``pdd.testing.gguf_files``); transformers (an independent reading of
names, layouts and the q/k permutation) and our loader then load that one file, and
the logits must agree in float32. The tokenizer built from the file's metadata must
encode as the checkpoint's own tokenizer.json does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from pdd.common.gguf_file import GGUFError, GGUFModelFile
from pdd.testing.gguf_files import write_gguf
from pdd.worker.model import load_model
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.errors import CorruptCheckpointError
from pdd.worker.model.kv_cache import PagedKVCache

pytestmark = pytest.mark.unit

BLOCK_SIZE = 8
# K-quants pack 256 values per block: rows of every matrix are a multiple of 256 long.
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}

CASES = {
    "llama-f32": ("llama", "F32", {}),
    "llama-f16": ("llama", "F16", {}),
    "llama-bf16": ("llama", "BF16", {}),
    "llama-q8_0": ("llama", "Q8_0", {}),
    "llama-q4_0": ("llama", "Q4_0", {}),
    "llama-q4_1-tied": ("llama", "Q4_1", {"tie_word_embeddings": True}),
    "llama-q4_k": ("llama", "Q4_K", {}),
    "llama-q6_k": ("llama", "Q6_K", {}),
    "qwen2-q8_0": ("qwen2", "Q8_0", {}),
    # transformers' GGUF reader ignores qwen3.attention.key_length and takes Qwen3's
    # default head_dim of 128: the case uses that head size so both read one shape.
    "qwen3-q4_1": (
        "qwen3",
        "Q4_1",
        {"head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
    ),
}


def gguf_from_checkpoint(ckpt: Path, arch: str, matrix_type: str) -> Path:
    config = json.loads((ckpt / "config.json").read_text())
    tensors = load_file(str(ckpt / "model.safetensors"))
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    out = ckpt.parent / f"{arch}-{matrix_type}.gguf"
    return write_gguf(out, arch, config, tensors, tokenizer, matrix_type)


def hf_gguf_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([p])).logits[0] for p in prompts]


def our_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    loaded = load_model(str(path), dtype="float32")
    kv = PagedKVCache(loaded.kv_layout(BLOCK_SIZE), 32, "cpu")
    free = list(range(32))
    seqs = []
    for p in prompts:
        n = -(-len(p) // BLOCK_SIZE)
        table, free = free[:n], free[n:]
        seqs.append(SeqInput(p, 0, table, all_logits=True))
    logits = loaded.model(ForwardBatch.build(seqs, BLOCK_SIZE, "cpu"), kv)
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize("case", CASES)
def test_gguf_logits_match_transformers_gguf_loader(case: str, hf_checkpoint) -> None:
    arch, matrix_type, overrides = CASES[case]
    path = gguf_from_checkpoint(hf_checkpoint(arch, **{**SHAPE, **overrides}), arch, matrix_type)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (5, 37)]

    expected, actual = hf_gguf_logits(path, prompts), our_logits(path, prompts)

    for exp, act in zip(expected, actual, strict=True):
        assert act.shape == exp.shape
        scale = exp.abs().max().item()
        assert (act - exp).abs().max().item() < 1e-4 * max(1.0, scale)


def test_quantized_file_differs_from_its_source_but_loads_close(hf_checkpoint) -> None:
    """Q8_0 really is quantized (a loader that ignored the blocks' scales, or read F32
    by mistake, would not land within int8's error of the float weights)."""
    ckpt = hf_checkpoint("llama", **SHAPE)
    source = load_model(str(ckpt), dtype="float32").model.state_dict()
    q8 = load_model(str(gguf_from_checkpoint(ckpt, "llama", "Q8_0")), "float32").model
    for name, value in q8.state_dict().items():
        if value.ndim == 2:
            err = (value - source[name]).abs().max().item()
            assert 0 < err < 0.02 * source[name].abs().max().item(), name


def test_tokenizer_and_template_come_from_the_metadata(hf_checkpoint) -> None:
    ckpt = hf_checkpoint("qwen3", **SHAPE)
    path = gguf_from_checkpoint(ckpt, "qwen3", "F16")
    own = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    loaded = load_model(str(path), dtype="float32")
    gguf = GGUFModelFile(path)
    for text in ("The quick brown fox.", "Über naïve café 🙂 42 tokens", " spaces  here\n"):
        assert loaded.tokenizer.encode(text) == own.encode(text).ids
        ids = own.encode(text, add_special_tokens=False).ids
        assert loaded.tokenizer.decode(ids) == own.decode(ids)
    assert loaded.tokenizer.eos_token_ids == (1,)
    assert "<|im_start|>" in (gguf.chat_template or "")
    assert gguf.special_tokens()["bos_token"] == "<s>"


def test_unsupported_tensor_type_is_named(hf_checkpoint) -> None:
    ckpt = hf_checkpoint("llama", **SHAPE)
    path = gguf_from_checkpoint(ckpt, "llama", "TQ2_0")
    with pytest.raises(CorruptCheckpointError, match=r"TQ2_0; supported tensor types: F32"):
        load_model(str(path))


def test_unsupported_architecture_and_damage_are_clear_errors(hf_checkpoint, tmp_path) -> None:
    path = gguf_from_checkpoint(hf_checkpoint("llama", **SHAPE), "llama", "F16")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        truncated = tmp_path / "cut.gguf"
        truncated.write_bytes(path.read_bytes()[:1000])
        GGUFModelFile(truncated)
    other = tmp_path / "other.gguf"
    shutil.copy(path, other)
    data = bytearray(other.read_bytes())
    at = data.index(b"llama")
    data[at : at + 5] = b"gemma"
    other.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="architecture 'gemma' is not supported"):
        load_model(str(other))
