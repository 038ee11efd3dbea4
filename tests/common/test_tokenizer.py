"""Byte tokenizer of the tiny preset and the tokenizer.json wrapper."""

from __future__ import annotations

import pytest

from pdd.common.tokenizer import ByteTokenizer, HFTokenizer
from pdd.testing.tokenizers import train_byte_bpe

pytestmark = pytest.mark.unit


def test_byte_tokenizer_round_trips_unicode() -> None:
    tok = ByteTokenizer()
    text = "naïve café 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 259 and tok.eos_token_ids == (257,)


def test_byte_tokenizer_decode_drops_specials_and_survives_broken_utf8() -> None:
    tok = ByteTokenizer()
    assert tok.decode([256, *b"hi", 257, 258]) == "hi"
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"  # a truncated 4-byte sequence


def test_hf_tokenizer_from_tokenizer_json(tmp_path) -> None:
    corpus = ["The quick brown fox jumps over the lazy dog."] * 20
    train_byte_bpe(corpus, 320, ["<s>", "</s>"], bos="<s>").save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "tokenizer.json", eos_token_ids=[1])
    ids = tok.encode("The quick brown fox")
    assert ids[0] == 0 and len(ids) < len("The quick brown fox")  # BOS, then merges
    assert tok.decode(ids) == "The quick brown fox"
    assert tok.eos_token_ids == (1,)
    assert tok.vocab_size <= 320
