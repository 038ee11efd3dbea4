"""Our decoder against transformers on checkpoints transformers itself wrote.

A padded batch of prompts of different lengths goes through transformers (right
padding + attention_mask) and, as a ragged ForwardBatch, through ours; logits at every
real position must agree to 1e-4 in fp32.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdd.worker.model import load_model
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import PagedKVCache

pytestmark = pytest.mark.unit

BLOCK_SIZE = 8
PROMPT_LENS = (7, 33, 90)  # past original_max_position_embeddings=64 of the scaled ropes

CASES = {
    "llama": ("llama", {}),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-rope-linear": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}},
    ),
    "llama-rope-dynamic": (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    ),
    "llama-tied-biases": (
        "llama",
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ),
    "llama-sharded": ("llama", {"max_shard_size": "40KB"}),
    "qwen2": ("qwen2", {}),
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "qwen3-sharded-tied": ("qwen3", {"max_shard_size": "40KB", "tie_word_embeddings": True}),
}


def hf_logits(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits per prompt, from one right-padded batch."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return [logits[i, : len(p)] for i, p in enumerate(prompts)]


def our_logits(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Our logits per prompt, from one ragged prefill into blocks handed out backwards."""
    loaded = load_model(str(path), dtype="float32")
    kv = PagedKVCache(loaded.kv_layout(BLOCK_SIZE), 64, "cpu")
    free = list(range(63, -1, -1))
    seqs = []
    for p in prompts:
        n_blocks = -(-len(p) // BLOCK_SIZE)
        table, free = free[:n_blocks], free[n_blocks:]
        seqs.append(SeqInput(p, 0, table, all_logits=True))
    logits = loaded.model(ForwardBatch.build(seqs, BLOCK_SIZE, "cpu"), kv)
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_on_padded_batch(case: str, hf_checkpoint) -> None:
    arch, overrides = CASES[case]
    path = hf_checkpoint(arch, **overrides)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in PROMPT_LENS]

    expected, actual = hf_logits(path, prompts), our_logits(path, prompts)

    for exp, act in zip(expected, actual, strict=True):
        assert act.shape == exp.shape
        assert (act - exp).abs().max().item() < 1e-4


def test_equal_length_batch_matches_transformers(hf_checkpoint) -> None:
    """No padding at all: the batch takes the mask-free causal attention path."""
    path = hf_checkpoint("qwen3")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (24,), generator=gen).tolist() for _ in range(3)]
    for exp, act in zip(hf_logits(path, prompts), our_logits(path, prompts), strict=True):
        assert (act - exp).abs().max().item() < 1e-4


def test_sharded_case_really_is_sharded(hf_checkpoint) -> None:
    path = hf_checkpoint("llama", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1


def test_tied_case_has_no_lm_head(hf_checkpoint) -> None:
    loaded = load_model(str(hf_checkpoint("qwen2", tie_word_embeddings=True)))
    assert loaded.model.lm_head is None
