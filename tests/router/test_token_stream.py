"""TokenStreamMerger: one ordered, gapless, duplicate-free stream from several sources."""

from __future__ import annotations

import random

import pytest

from pdd.common.wire import TokenEvent
from pdd.router.token_stream import TokenConflictError, TokenStreamMerger

pytestmark = pytest.mark.unit


def ev(seq: int, token: int, source: str = "rld", finished: bool = False) -> TokenEvent:
    return TokenEvent(
        request_id="r",
        seq=seq,
        token_id=token,
        source=source,
        finished=finished,
        finish_reason="length" if finished else None,
    )


def test_handoff_overlap_is_emitted_once_in_order() -> None:
    merger = TokenStreamMerger("r")
    out = []
    for seq in range(5):
        out += merger.accept(ev(seq, 100 + seq, "rld"))
    # MD re-reports the last two positions (catch-up overlap), then continues.
    for seq in range(3, 8):
        out += merger.accept(ev(seq, 100 + seq, "md", finished=seq == 7))
    assert [e.seq for e in out] == list(range(8))
    assert [e.source for e in out] == ["rld"] * 5 + ["md"] * 3
    assert merger.duplicates == 2
    assert merger.finished
    assert merger.token_ids == [100 + s for s in range(8)]


def test_out_of_order_positions_wait_for_the_gap() -> None:
    merger = TokenStreamMerger("r")
    assert merger.accept(ev(0, 1)) == [ev(0, 1)]
    assert merger.accept(ev(2, 3, "md")) == []
    assert merger.accept(ev(4, 5, "md")) == []
    assert merger.gaps == [1, 3]
    released = merger.accept(ev(1, 2))
    assert [e.seq for e in released] == [1, 2]
    assert merger.gaps == [3]


def test_any_interleaving_yields_the_same_stream() -> None:
    tokens = [random.Random(7).randrange(256) for _ in range(40)]
    rld = [ev(s, t, "rld") for s, t in enumerate(tokens[:25])]
    md = [ev(s, t, "md", finished=s == 39) for s, t in enumerate(tokens) if s >= 20]
    for trial in range(20):
        events = rld + md
        random.Random(trial).shuffle(events)
        merger = TokenStreamMerger("r")
        out = [e for event in events for e in merger.accept(event)]
        assert [e.token_id for e in out] == tokens
        assert merger.duplicates == 5
        assert merger.finished and merger.gaps == []


def test_conflicting_tokens_raise() -> None:
    merger = TokenStreamMerger("r")
    merger.accept(ev(0, 1, "rld"))
    with pytest.raises(TokenConflictError, match="position 0"):
        merger.accept(ev(0, 2, "md"))
    merger.accept(ev(3, 9, "rld"))
    with pytest.raises(TokenConflictError, match="position 3"):
        merger.accept(ev(3, 8, "md"))


def test_nothing_after_the_finish() -> None:
    merger = TokenStreamMerger("r")
    merger.accept(ev(0, 1, finished=True))
    assert merger.accept(ev(1, 2, "md")) == []
    assert merger.token_ids == [1]


def test_status_events_record_errors_without_tokens() -> None:
    merger = TokenStreamMerger("r")
    status = TokenEvent(request_id="r", seq=3, source="md", error="wan transfer timed out")
    assert merger.accept(status) == []
    assert merger.errors == {"md": "wan transfer timed out"}
    assert merger.next_seq == 0


def test_foreign_request_is_refused() -> None:
    with pytest.raises(ValueError, match="merger of 'r'"):
        TokenStreamMerger("r").accept(TokenEvent(request_id="x", seq=0, token_id=1, source="a"))


def test_a_finish_on_an_already_released_token_ends_the_stream_without_a_repeat() -> None:
    merger = TokenStreamMerger("r")
    merger.accept(ev(0, 1, "rld"))
    merger.accept(ev(1, 2, "md"))
    assert not merger.finished
    [finish] = merger.accept(ev(1, 2, "md", finished=True))
    assert not finish.is_token and finish.finished and finish.finish_reason == "length"
    assert finish.seq == 2  # the end comes after the two positions released
    assert merger.finished and merger.token_ids == [1, 2] and merger.duplicates == 0
    assert merger.accept(ev(1, 2, "md", finished=True)) == []  # a finish is told once
    assert merger.accept(ev(2, 3, "rld")) == []  # nothing after the finish
    assert merger.token_ids == [1, 2]


def test_a_finish_on_a_position_not_yet_released_ends_the_stream_there() -> None:
    merger = TokenStreamMerger("r")
    merger.accept(ev(1, 2, "md"))
    merger.accept(ev(2, 3, "md"))
    assert merger.accept(ev(1, 2, "md", finished=True)) == []  # position 0 still missing
    released = merger.accept(ev(0, 1, "rld"))
    assert [(e.seq, e.finished) for e in released] == [(0, False), (1, True)]
    assert merger.finished and merger.token_ids == [1, 2]


def test_an_error_that_names_another_instance_blames_that_one() -> None:
    merger = TokenStreamMerger("r")
    merger.accept(TokenEvent(request_id="r", seq=0, source="md", error="KV stopped", culprit="p"))
    merger.accept(TokenEvent(request_id="r", seq=0, source="rld", error="broke"))
    assert merger.errors == {"md": "KV stopped", "rld": "broke"}
    assert merger.failed == ("p", "rld")
