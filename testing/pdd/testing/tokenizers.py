"""Tiny byte-level BPE tokenizers trained in a test's own process (no downloads).

Tests of the tokenizer interface, the router's chat templates and checkpoint loading
all need a real ``tokenizer.json``; this trains one on a few sentences in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers


def train_byte_bpe(
    corpus: Sequence[str],
    vocab_size: int,
    special_tokens: Sequence[str],
    bos: str | None = None,
) -> Tokenizer:
    """A byte-level BPE over ``corpus``; special tokens get the first ids, in order, and
    ``bos`` (one of them) is prepended to every encoded text when given."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok
