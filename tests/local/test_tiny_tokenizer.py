"""The tiny model's tokenizer files (``pdd tiny-tokenizer``) count as the served model does."""

import pytest
from transformers import AutoTokenizer

from pdd.common.tokenizer import ByteTokenizer
from pdd.local.tiny_tokenizer import main

pytestmark = pytest.mark.unit

TEXTS = ["hello world", "Über naïve café 🙂", " \n\t leading space", "<b>markup</b>", ""]


def test_transformers_reads_the_files_with_the_byte_tokenizers_ids(tmp_path) -> None:
    assert main([str(tmp_path / "tok")]) == 0
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ours = ByteTokenizer()
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == ours.encode(text)
        assert hf.decode(ids) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (256, 257, 258)
    assert len(hf) == ours.vocab_size
