"""Every ``pdd`` process's log: one record is one line, whatever a client put in it.

A message may carry what a client sent (a URL path, a field name, a header); its CR,
LF, NUL, terminal escapes and Unicode line separators must not reach the file raw, or
one request could forge a whole record (or drive the reader's terminal)."""

from __future__ import annotations

import json
import logging

import pytest

from pdd.common.logs import JsonFormatter, TextFormatter, printable

pytestmark = pytest.mark.unit

#: What a hostile client gets into a message: a forged record after CR LF, a NUL, an ANSI
#: escape, a tab, the C1 line break NEL, DEL, Unicode's line separator, a bidi override.
FORGED = "2026-01-01 00:00:00,000 pdd.router.access INFO request_id=forged status=200"
HOSTILE = f"/v1/x\r\n{FORGED}\x00\x1b[2J\t\x85\x7f\u2028\u202e"


def record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("pdd.x", logging.INFO, __file__, 1, message, args, exc_info)


def test_printable_escapes_what_is_not_printable_and_keeps_the_rest():
    assert printable("plain /v1/x café 東京") == "plain /v1/x café 東京"
    assert printable("a\r\nb\x00c\x1bd\te\x85f\x7fg\u2028h\U000e0001") == (
        "a\\x0d\\x0ab\\x00c\\x1bd\\x09e\\x85f\\x7fg\\u2028h\\U000e0001"
    )


def test_a_text_record_is_one_line_whatever_its_arguments_hold():
    line = TextFormatter().format(record("path=%s", HOSTILE))
    assert len(line.splitlines()) == 1 and line.isprintable(), repr(line)
    escaped = "\\x00\\x1b[2J\\x09\\x85\\x7f\\u2028\\u202e"
    assert line.endswith(f"path=/v1/x\\x0d\\x0a{FORGED}{escaped}")


def test_a_traceback_is_indented_so_no_line_of_it_passes_for_a_record():
    try:
        raise ValueError(HOSTILE)
    except ValueError as caught:
        exc = caught
    text = TextFormatter().format(record("unhandled error", exc=exc))
    first, *rest = text.split("\n")
    assert first.endswith("unhandled error") and rest
    assert rest[0] == "  Traceback (most recent call last):"
    for line in rest:
        assert line.startswith("  ") and line.isprintable(), repr(line)
    assert "request_id=forged" in rest[-1]  # the message is kept, escaped, on its line


def test_a_json_record_is_one_line_and_gives_back_exactly_what_was_logged():
    try:
        raise ValueError(HOSTILE)
    except ValueError as caught:
        exc = caught
    rec = record("path=%s", HOSTILE, exc=exc)
    rec.fields = {"path": HOSTILE}
    line = JsonFormatter().format(rec)
    assert len(line.splitlines()) == 1 and line.isprintable() and line.isascii()
    entry = json.loads(line)
    assert entry["path"] == HOSTILE and entry["msg"] == f"path={HOSTILE}"
    assert HOSTILE in entry["exc"]
