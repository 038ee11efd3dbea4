"""Tokenizers: the checkpoint's own (tokenizer.json) or the tiny preset's bytes.

The engine needs only encode, decode and the ids that end a generation; both kinds
satisfy the ``Tokenizer`` protocol so the engine never asks which one it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import tokenizers


class Tokenizer(Protocol):
    """What the engine and the servers use of a tokenizer."""

    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then bos/eos/pad: needs no file and never fails.

    encode adds no special tokens; decode drops them and replaces broken UTF-8
    (a byte-level model may emit any byte sequence).
    """

    def __init__(self, bos_id: int = 256, eos_id: int = 257, pad_id: int = 258) -> None:
        self.bos_token_id, self.pad_token_id = bos_id, pad_id
        self.eos_token_ids: tuple[int, ...] = (eos_id,)
        self.vocab_size = max(bos_id, eos_id, pad_id) + 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package.

    The eos ids come from the model's config (and generation_config.json), not from
    the tokenizer file, which does not say which of its special tokens ends a turn.
    """

    def __init__(
        self,
        path: Path | None,
        eos_token_ids: Sequence[int],
        tokenizer: tokenizers.Tokenizer | None = None,
    ) -> None:
        self._tok = (
            tokenizer if tokenizer is not None else tokenizers.Tokenizer.from_file(str(path))
        )
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: tokenizers.Tokenizer, eos_token_ids: Sequence[int]
    ) -> HFTokenizer:
        """One built in memory (a GGUF file's vocabulary and merges)."""
        return cls(None, eos_token_ids, tokenizer)

    def encode(self, text: str) -> list[int]:
        """Ids as the tokenizer's post-processor defines them (e.g. with Llama's BOS)."""
        return self._tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (a grammar engine reads the vocabulary
        from it)."""
        return self._tok.to_str()
