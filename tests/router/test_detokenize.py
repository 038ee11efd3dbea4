"""Incremental detokenizing and stop strings."""

import pytest

from pdd.router.detokenize import IncrementalDetokenizer, StopStrings
from pdd.router.tokenization import TinyTokenizer

pytestmark = pytest.mark.unit


def test_multibyte_characters_are_never_split():
    text = "naïve café — 東京 🚀 done"
    detok = IncrementalDetokenizer(TinyTokenizer())
    deltas = [detok.push(b) for b in text.encode()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_character_cut_off_by_the_end_of_output_still_comes_out():
    """A byte-level model may stop mid-character: the full text is decode(ids), U+FFFD
    included, not the text minus the unfinished character."""
    ids = list("ok 東".encode())[:-1]  # the last character's final byte never comes
    detok = IncrementalDetokenizer(TinyTokenizer())
    streamed = "".join(detok.push(i) for i in ids)
    assert streamed == "ok "
    assert streamed + detok.finish() == TinyTokenizer().decode(ids) == "ok \ufffd"
    assert detok.finish() == ""  # nothing is emitted twice


def test_a_bpe_tokenizer_streams_the_same_text_it_decodes(write_checkpoint):
    from pdd.router.tokenization import load_prompt_tokenizer

    tok = load_prompt_tokenizer(write_checkpoint(None, None, "<|eot_id|>")).tokenizer
    ids = tok.encode("hello world, how are you today? The quick brown fox", False)
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in ids) == tok.decode(ids)


def feed_all(stops: StopStrings, pieces: list[str]) -> tuple[str, bool]:
    out = ""
    for piece in pieces:
        text, stopped = stops.feed(piece)
        out += text
        if stopped:
            return out, True
    return out + stops.flush(), False


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        (["Hello", " wor", "ld\n\nUs", "er: more"], ("Hello world", True)),
        (["ab", "c", "EN", "D", "tail"], ("abc", True)),
        (["no stop ", "E", "N here"], ("no stop EN here", False)),
        (["E"], ("E", False)),
    ],
)
def test_stop_strings_cut_across_token_boundaries(pieces, expected):
    assert feed_all(StopStrings(["\n\nUser:", "END"]), pieces) == expected


def test_without_stop_strings_text_passes_through():
    assert StopStrings([]).feed("anything") == ("anything", False)
