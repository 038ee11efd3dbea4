"""A logprob entry's ``bytes``: the raw bytes each token stands for, also for a token that
holds only part of a character."""

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pdd.router.tokenization import _BYTE_OF_CHAR, HFTokenizer, TinyTokenizer
from pdd.testing.tokenizers import train_byte_bpe

pytestmark = pytest.mark.unit

TEXT = "naïve café — 日本語 ok"


def test_byte_level_table_is_gpt2s() -> None:
    assert {c: b for b, c in bytes_to_unicode().items()} == _BYTE_OF_CHAR


def test_byte_level_tokens_give_back_the_utf8_bytes(tmp_path) -> None:
    path = tmp_path / "tokenizer.json"
    train_byte_bpe(["hello world", "naïve café"] * 5, 300, ["<|eot|>"]).save(str(path))
    tok = HFTokenizer(path)
    ids = tok.encode(TEXT)
    assert b"".join(tok.token_bytes(i) for i in ids) == TEXT.encode()
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # split characters exist
    assert tok.token_bytes(0) == b""  # the special token decodes to nothing


def test_tiny_tokens_are_bytes() -> None:
    tok = TinyTokenizer()
    ids = tok.encode(TEXT)
    assert b"".join(tok.token_bytes(i) for i in ids) == TEXT.encode()
    assert tok.token_bytes(256) == b""
