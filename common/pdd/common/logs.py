"""Logging for every long-running ``pdd`` command: level and format flags, and one setup.

``--log-level`` takes logging's level names in any case; ``--log-format json`` writes
one JSON object per line (time, level, logger, message and a record's ``fields``, e.g.
the router's access-log entries), which log shippers parse without a pattern. At INFO
and above, libraries' own chatter (HTTP clients, uvicorn's access lines, the compiler)
is held back to warnings, so the log holds what PDD itself says.

One record is one line, in either format, whatever a message carries of what a client
sent (a URL path, a header, a field name): the text format escapes every character that
is not printable (``printable``: CR, LF, NUL, terminal escapes, Unicode's line breaks)
and indents a traceback's lines, so no line of one passes for a record; JSON escapes
them by its own rules.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

#: ``--log-level`` choices, as logging spells them (lower case); any case is accepted.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
#: ``--log-format`` choices.
LOG_FORMATS = ("text", "json")
#: Loggers of libraries that say too much at INFO for a server's log.
NOISY_LIBRARIES = (
    "httpx", "httpcore", "urllib3", "asyncio", "uvicorn.access", "uvicorn.error",
    "torch", "torch._inductor", "torch.utils.cpp_extension",
)  # fmt: skip
#: The attribute a record's structured fields travel in (``log.info(..., extra={FIELDS: {}})``).
FIELDS = "fields"
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
#: What starts each line of a traceback in the text format (a record starts with its date).
TRACEBACK_INDENT = "  "


def log_level(text: str) -> str:
    """``--log-level`` in any case -> logging's upper-case level name."""
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid level {text!r} (choose from {', '.join(LOG_LEVELS)})"
        )
    return text.upper()


def add_log_flags(p: argparse.ArgumentParser, default_level: str = "info") -> None:
    """``--log-level`` (any case, choices listed) and ``--log-format``."""
    p.add_argument(
        "--log-level",
        type=log_level,
        default=default_level.upper(),
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help=f"log verbosity, any case (default: {default_level})",
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines, or one JSON object per line for log shippers (default: text)",
    )


def printable(text: str) -> str:
    """``text`` with each character that is not printable written as an escape
    (``\\x0d``, ``\\u2028``, ``\\U000e0001``): control characters, DEL, the C1 controls,
    separators other than the space, format characters. What a client sent then cannot
    end a log line early, start a forged one, or drive the reader's terminal; printable
    text (any script) is kept as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, one record per line: the message is made ``printable``, and a
    traceback (or stack) is indented, each of its lines made printable, so only a
    record's own first line starts at the left margin."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join(TRACEBACK_INDENT + printable(line) for line in text.split("\n"))


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, the record's fields, exc.
    ``json.dumps`` escapes control characters and (``ensure_ascii``) all of non-ASCII, so
    the object is one printable line whatever its strings hold."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, FIELDS, None) or {})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, fmt: str = "text") -> None:
    """The process's logging: ``level`` (a level name), ``fmt`` text or json, and the
    libraries held to warnings unless ``level`` is DEBUG."""
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig: a host's own handlers (tests) stay
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
        root.addHandler(handler)
    root.setLevel(level)
    library_level = logging.DEBUG if level == "DEBUG" else logging.WARNING
    for name in NOISY_LIBRARIES:
        logging.getLogger(name).setLevel(library_level)
