"""Prompt -> token IDs in the router, identical to what the workers would compute.

The router tokenizes to hash the prompt's blocks for the prefix index, so its IDs must
equal the workers'. No torch: a checkpoint's ``tokenizer.json`` is read with the
``tokenizers`` package (with the same defaults as the worker's ``HFTokenizer``), and
the built-in ``tiny`` preset uses the worker's own byte tokenizer (ids 0..255 are
UTF-8 bytes, then BOS, EOS, PAD), imported because that module is torch-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as HFRustTokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder

from pdd.common.gguf_file import GGUFError, GGUFModelFile, gguf_checkpoint
from pdd.common.tokenizer import ByteTokenizer
from pdd.router.chat_template import (
    PLAIN_TOOL_INSTRUCTION,
    ChatTemplate,
    check_template_kwargs,
    find_chat_template,
    render_plain,
    special_tokens_from_config,
)

#: The model name that selects the built-in byte-level tiny preset.
TINY_MODEL = "tiny"


class TokenizerNotFoundError(FileNotFoundError):
    """The model path has no tokenizer the router can read."""


class TokenIdError(ValueError):
    """A prompt given as token IDs holds one outside the vocabulary."""


class Tokenizer(Protocol):
    """What the router needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Token IDs are ``0 .. vocab_size - 1`` (added tokens included)."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a logprob entry's ``bytes``): a token that
        holds part of a character has bytes even where its text alone is U+FFFD."""
        ...


class TinyTokenizer:
    """The tiny preset's tokens, from the worker's own (torch-free) byte tokenizer, so
    the IDs cannot drift: UTF-8 bytes 0..255, and no special token is ever added (the
    worker's generate path does not add BOS either)."""

    def __init__(self) -> None:
        self._bytes = ByteTokenizer()

    @property
    def vocab_size(self) -> int:
        return self._bytes.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._bytes.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._bytes.decode(token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""  # special tokens: none


class HFTokenizer:
    """A checkpoint's ``tokenizer.json`` through the Rust ``tokenizers`` package."""

    def __init__(self, path: Path | None, tokenizer: HFRustTokenizer | None = None) -> None:
        self._tok = tokenizer if tokenizer is not None else HFRustTokenizer.from_file(str(path))
        added = self._tok.get_added_tokens_decoder()
        self._special = frozenset(i for i, t in added.items() if t.special)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """Byte-level BPE (GPT-2, Llama-3, Qwen) maps each byte to one printable char of
        the token's string, and byte-fallback vocabularies (Llama-2) spell a raw byte
        ``<0xHH>``; other tokens are their decoded text. A special token has none, as it
        has no text (``decode`` skips it)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None or token_id in self._special:
            return b""
        if isinstance(self._tok.decoder, ByteLevelDecoder) and all(
            c in _BYTE_OF_CHAR for c in piece
        ):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return self.decode([token_id]).encode()


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()


@dataclass(frozen=True)
class PromptTokenizer:
    """Turns chat messages or a completion prompt into the token IDs the model sees."""

    tokenizer: Tokenizer
    template: ChatTemplate | None = None

    def chat_ids(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Render and tokenize. A template already writes BOS into the text, so (as in
        transformers' ``apply_chat_template``) special tokens are not added again; the
        plain fallback has no BOS of its own, so the tokenizer adds its special
        tokens, exactly as for a completion prompt. ``template_kwargs``
        (``chat_template_kwargs``) may not set what the router sets
        (``ReservedKwargError``), with a template or without."""
        check_template_kwargs(template_kwargs or {})
        if self.template is None:
            text = render_plain(messages, add_generation_prompt, tools)
            return self.tokenizer.encode(text, add_special_tokens=True)
        text = self.template.render(
            messages, add_generation_prompt, tools, **(template_kwargs or {})
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def template_source(self) -> str:
        """The template that renders chat prompts (the plain fallback's tool instruction
        where the checkpoint has none): what ``tool_calls.detect_format`` reads."""
        return self.template.source if self.template is not None else PLAIN_TOOL_INSTRUCTION

    def completion_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A text prompt gets the tokenizer's special tokens; given IDs pass through, once
        each is known to be a token of this vocabulary (else ``TokenIdError``)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        vocab = self.tokenizer.vocab_size
        for position, token in enumerate(prompt):
            if not 0 <= token < vocab:
                raise TokenIdError(
                    f"prompt[{position}] is token ID {token}; this model's IDs are 0..{vocab - 1}"
                )
        return list(prompt)


def load_prompt_tokenizer(model: str | Path) -> PromptTokenizer:
    """``tiny`` -> the byte tokenizer; a checkpoint directory -> its tokenizer and template;
    a GGUF file -> the tokenizer and template in its metadata."""
    if str(model) == TINY_MODEL:
        return PromptTokenizer(TinyTokenizer())
    gguf_file = gguf_checkpoint(model)
    if gguf_file is not None:
        return _gguf_prompt_tokenizer(gguf_file)
    model_dir = Path(model)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerNotFoundError(
            f"{tokenizer_file} not found: the router needs the checkpoint's tokenizer.json "
            f"(or model name {TINY_MODEL!r} for the built-in byte tokenizer)"
        )
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    source = find_chat_template(model_dir, config)
    template = ChatTemplate(source, special_tokens_from_config(config)) if source else None
    return PromptTokenizer(HFTokenizer(tokenizer_file), template)


def _gguf_prompt_tokenizer(path: Path) -> PromptTokenizer:
    try:
        gguf = GGUFModelFile(path)
        tokenizer = HFTokenizer(None, gguf.tokenizer())
    except GGUFError as e:
        raise TokenizerNotFoundError(str(e)) from e
    config = gguf.tokenizer_config()
    source = gguf.chat_template
    template = ChatTemplate(source, special_tokens_from_config(config)) if source else None
    return PromptTokenizer(tokenizer, template)
