"""The Llama-family causal LM (Llama, Qwen2, Qwen3) over a paged KV cache.

Module names mirror transformers' (``model.layers.N.self_attn...``) so the loader maps
checkpoint tensors by name; only the fused projections differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdd.worker.model.batch import ForwardBatch, InvalidBatchError
from pdd.worker.model.config import ModelConfig
from pdd.worker.model.cpu_kernels import CpuKernels
from pdd.worker.model.kv_cache import PagedKVCache
from pdd.worker.model.layers import (
    DecoderLayer,
    LayerInputs,
    Linear,
    PackedWeight,
    RMSNorm,
    additive_mask,
)
from pdd.worker.model.rope import RotaryEmbedding


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (transformers' ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # The weight is given, not initialised: models are built on the meta device and
        # then loaded, and Embedding's own normal_() init on meta imports torch._dynamo
        # (about 3 s of every worker process's start) for values nobody reads.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; one ``forward`` serves every kind of step (see batch.py).

    With tied embeddings there is no ``lm_head`` module: the logits reuse the
    embedding matrix, so the weight exists once in memory and in the state dict.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._packed_head: PackedWeight | None = None
        # The compiled CPU kernels, chosen by the loader (None: torch's ops throughout).
        self.kernels: CpuKernels | None = None
        self.rotary = RotaryEmbedding(config, device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Append the batch's new tokens to the cache; fp32 logits [N, vocab] for
        ``batch.logits_indices`` (the last new token of each sequence, or all of them).

        Raises InvalidBatchError when a sequence would pass max_position_embeddings,
        where no RoPE table entry (and no trained behaviour) exists.
        """
        longest = max(batch.kv_lens)
        if longest > self.config.max_position_embeddings:
            raise InvalidBatchError(
                f"a sequence reaches {longest} tokens but the model's context window is "
                f"{self.config.max_position_embeddings}; cap prompt + max_tokens to it"
            )
        paged = self.kernels.paged_attention if self.kernels is not None else None
        if batch.token_tables is not None and paged is None:
            raise ValueError("a batch built paged needs a model with the paged CPU kernel")
        h = self.model.embed_tokens(batch.input_ids)
        inputs = LayerInputs(
            batch,
            kv,
            self.rotary.cos_sin(batch.positions, h.dtype),
            tuple(additive_mask(g.attn_mask, h.dtype) for g in batch.groups),
            self.kernels,
        )
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, inputs)
        assert residual is not None  # a model has at least one layer
        last = batch.logits_indices
        h, _ = self.model.norm.add(
            h.index_select(0, last), residual.index_select(0, last), self.kernels
        )
        if self._packed_head is not None:
            return self._packed_head(h).float()
        if self.lm_head is not None:
            return self.lm_head(h).float()
        return F.linear(h, self.model.embed_tokens.weight).float()

    def pack_weights(self, compute_dtype: torch.dtype) -> None:
        """Prepack every projection and the LM head for oneDNN in ``compute_dtype``
        (see ``layers.Linear`` and ``layers.pack_dtype``, which says where that pays); a
        tied head gets its own packed copy of the embedding matrix, which the embedding
        lookup keeps reading plain."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(compute_dtype)
        if self.lm_head is None:
            weight = self.model.embed_tokens.weight
            self._packed_head = PackedWeight.of(weight, None, compute_dtype)
