"""Router token IDs equal the workers' and transformers' for the same text."""

import re

import pytest
from transformers import AutoTokenizer

from pdd.common.tokenizer import ByteTokenizer
from pdd.common.tokenizer import HFTokenizer as WorkerHFTokenizer
from pdd.router.tokenization import TokenIdError, TokenizerNotFoundError, load_prompt_tokenizer

pytestmark = pytest.mark.unit

TEXT = "hello world, ünïcödé ✓ 🚀"


def test_tiny_ids_equal_the_worker_byte_tokenizer():
    tiny = load_prompt_tokenizer("tiny")
    assert tiny.completion_ids(TEXT) == ByteTokenizer().encode(TEXT)
    assert tiny.completion_ids(TEXT) == list(TEXT.encode("utf-8"))
    assert tiny.tokenizer.decode([256, *TEXT.encode("utf-8"), 257]) == TEXT


def test_tiny_chat_uses_plain_fallback():
    tiny = load_prompt_tokenizer("tiny")
    assert tiny.template is None
    ids = tiny.chat_ids([{"role": "user", "content": "hi"}])
    assert bytes(ids).decode() == "user: hi\nassistant:"


def test_checkpoint_ids_equal_worker_and_transformers(write_checkpoint):
    model_dir = write_checkpoint(None, "<|begin_of_text|>", "<|eot_id|>")
    ours = load_prompt_tokenizer(model_dir)
    worker = WorkerHFTokenizer(model_dir / "tokenizer.json", eos_token_ids=[1])
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    assert ours.completion_ids(TEXT) == worker.encode(TEXT) == hf(TEXT)["input_ids"]
    assert ours.completion_ids(TEXT)[0] == hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert ours.tokenizer.decode(ours.completion_ids(TEXT)) == TEXT


def test_given_ids_pass_through():
    assert load_prompt_tokenizer("tiny").completion_ids([5, 6, 7]) == [5, 6, 7]


def test_missing_tokenizer_names_the_fix(tmp_path):
    with pytest.raises(TokenizerNotFoundError, match=r"tokenizer\.json"):
        load_prompt_tokenizer(tmp_path)


def test_prompt_token_ids_outside_the_vocabulary_are_refused_with_their_position() -> None:
    tokenizer = load_prompt_tokenizer("tiny")
    vocab = tokenizer.tokenizer.vocab_size
    assert tokenizer.completion_ids([0, vocab - 1]) == [0, vocab - 1]
    for bad, where in (([5, -1], "prompt[1] is token ID -1"), ([vocab], f"token ID {vocab};")):
        with pytest.raises(TokenIdError, match=re.escape(where)):
            tokenizer.completion_ids(bad)
