"""A grammar's first tokens, tried before admission: what the engine would meet first.

A grammar can compile and still fail in the engine at its first tokens: llguidance
computes the bytes a grammar forces after each token and gives up where they run on
without end (``{"c":{"c":...`` for an object whose required property is itself), or
finds no way to go on at all. So the router and the worker's control API run the
grammar's matcher over its first few tokens, as the engine's steps would (a mask, then
a token it allows), under the engine's own limits, on a vocabulary of bytes: what a
grammar allows is bytes, so whatever tokenizer a model has, the same grammar fails the
same way, and no model is needed to know it.
"""

from __future__ import annotations

import functools

import llguidance

from pdd.common.tokenizer import ByteTokenizer

#: Tokens the probe picks (each after a mask, as a step does); the engine gave up on the
#: grammar that once failed every request in its batch at its first.
PROBE_TOKENS = 4


class ByteVocabulary:
    """A byte tokenizer as llguidance reads a vocabulary: ids 0-255 are the bytes, the
    rest are special tokens that spell nothing (the ``tiny`` model's, and the probe's)."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        special = sorted({tokenizer.bos_token_id, *tokenizer.eos_token_ids, tokenizer.pad_token_id})
        self.special_token_ids = special
        self.tokens = [bytes([i]) for i in range(256)] + [
            f"<special_{i}>".encode() for i in range(256, tokenizer.vocab_size)
        ]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


def byte_tokenizer(tokenizer: ByteTokenizer) -> llguidance.LLTokenizer:
    """``tokenizer`` as llguidance's tokenizer."""
    wrapper = llguidance.TokenizerWrapper(ByteVocabulary(tokenizer))
    return llguidance.LLTokenizer(wrapper, eos_token=list(tokenizer.eos_token_ids))


@functools.cache
def _probe_tokenizer() -> llguidance.LLTokenizer:
    return byte_tokenizer(ByteTokenizer())


def first_failure(grammar: str, limits: llguidance.LLParserLimits) -> str | None:
    """Why the engine would fail ``grammar`` at its first tokens (it cannot compile, it
    gives up on it, it allows no output at all), or None."""
    matcher = llguidance.LLMatcher(_probe_tokenizer(), grammar, log_level=0, limits=limits)
    if matcher.is_error():
        return f"the structured-output grammar cannot be compiled: {_reason(matcher)}"
    for _ in range(PROBE_TOKENS):
        if matcher.is_stopped():
            return None
        mask = matcher.compute_bitmask()
        token = None if matcher.is_error() else _first_allowed(mask)
        if token is None and not matcher.is_error():
            return "the structured-output grammar allows no output at all"
        if token is None or not matcher.consume_token(token):
            return (
                "the grammar engine gives up on the structured-output grammar at its first "
                f"tokens: {_reason(matcher)}"
            )
    return None


def _first_allowed(bitmask: bytes) -> int | None:
    """The lowest token id a (little-endian) bitmask allows."""
    for i, byte in enumerate(bitmask):
        if byte:
            return i * 8 + (byte & -byte).bit_length() - 1
    return None


def _reason(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error, first line only (the rest is its parser state)."""
    return next(iter(matcher.get_error().strip().splitlines()), "no reason given")
