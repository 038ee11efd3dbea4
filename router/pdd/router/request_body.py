"""A request body from bytes to JSON, refusing what the code behind it cannot take.

The app reads the body under its size bound (``--max-body-bytes``); this module says
whether the body is declared as JSON (``Content-Type``), decodes it, and walks what it
decoded once (iteratively), refusing two things the JSON grammar allows:

- nesting deeper than ``MAX_JSON_DEPTH``: the decoder, pydantic, the chat template and
  the grammar compiler all recurse over the value; a body 100,000 arrays deep stopped
  Python's decoder with a RecursionError (a 500) before any of them ran;
- a lone surrogate (the escape ``"\\ud800"`` without its pair): valid JSON, but no
  Unicode character, so it has no UTF-8 form for the tokenizer or the workers. A
  server could replace it with U+FFFD and answer a prompt the client did not write;
  a 400 naming where it is tells the client what to fix instead.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdd.router.errors import InvalidRequestError, UnsupportedMediaTypeError

#: Containers inside containers a body may hold (the body itself is level 1). A chat
#: request with tools whose schemas nest objects ten deep (OpenAI's own limit for
#: structured output) stays under 40.
MAX_JSON_DEPTH = 64

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_content_type(value: str | None) -> None:
    """``application/json`` or ``application/<anything>+json`` (parameters such as
    ``charset`` aside), as FastAPI reads a JSON body; no ``Content-Type`` at all is taken
    as JSON too, as FastAPI takes it (a raw ``httpx`` post sends none). Anything else
    (``text/plain``, the form type ``curl -d`` sends without ``-H``) is a 415."""
    if not value:
        return
    media = value.split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    if kind == "application" and (subtype == "json" or subtype.endswith("+json")):
        return
    raise UnsupportedMediaTypeError(
        f"the body must be JSON (Content-Type: application/json), not {media or value!r}"
    )


def decode_json(raw: bytes) -> Any:
    """The body's JSON value, or an ``InvalidRequestError`` saying what is wrong with it."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise _too_deep() from None
    _check_tree(value)
    return value


def _check_tree(value: Any) -> None:
    """Depth and strings of every node, without recursion (the value may be deep)."""
    stack: list[tuple[Any, int, tuple[str, ...]]] = [(value, 0, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            _check_text(node, path)
        elif isinstance(node, dict | list):
            if depth + 1 > MAX_JSON_DEPTH:
                raise _too_deep()
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                at = (*path, str(key))
                if isinstance(key, str):
                    _check_text(key, at)
                stack.append((child, depth + 1, at))


def _check_text(text: str, path: tuple[str, ...]) -> None:
    found = _SURROGATE.search(text)
    if found is None:
        return
    where = ".".join(path) or None
    raise InvalidRequestError(
        f"{where or 'the body'}: the text holds a lone surrogate "
        f"(U+{ord(found.group()):04X}), which is not a Unicode character: send the "
        "character itself, or both halves of its surrogate pair",
        param=where,
    )


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(f"the body is nested more than {MAX_JSON_DEPTH} levels deep")
