"""Payload codecs for the small frames: token-ID handoff, errors, JSON metadata.

The token-ID handoff is the point of PDD's relay path: RLD sends MD the IDs
it generated, never their KV. So it is packed tight: an 8-byte header
(``u32 start_position | u32 count``) then ``count`` u32 little-endian IDs,
4 bytes per token (100 tokens are 408 bytes).
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

from pdd.worker.transport.errors import FrameError

M = TypeVar("M", bound=BaseModel)

_TOKEN_HEADER = struct.Struct("<II")
_U32 = "I" if array("I").itemsize == 4 else "L"


@dataclass(frozen=True)
class TokenIds:
    """Token IDs for positions ``[start, start + len(ids))`` of a request."""

    start: int
    ids: list[int]


def encode_token_ids(start: int, ids: Sequence[int]) -> bytes:
    """Pack ``ids`` (generated at positions ``start``...) for a TOKEN_IDS frame."""
    packed = array(_U32, ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return _TOKEN_HEADER.pack(start, len(packed)) + packed.tobytes()


def decode_token_ids(payload: bytes) -> TokenIds:
    """Inverse of ``encode_token_ids``; a count that disagrees with the size is a FrameError."""
    if len(payload) < _TOKEN_HEADER.size:
        raise FrameError(f"TOKEN_IDS payload of {len(payload)} bytes is shorter than its header")
    start, count = _TOKEN_HEADER.unpack_from(payload)
    body = payload[_TOKEN_HEADER.size :]
    if len(body) != 4 * count:
        raise FrameError(f"TOKEN_IDS header says {count} ids but carries {len(body)} bytes")
    packed = array(_U32)
    packed.frombytes(body)
    if sys.byteorder != "little":
        packed.byteswap()
    return TokenIds(start, packed.tolist())


def encode_json(obj: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON for META frames."""
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(payload: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"payload is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"JSON payload must be an object, got {type(obj).__name__}")
    return obj


def validated(model: type[M], obj: Mapping[str, object]) -> M:
    """``obj`` (a decoded JSON payload) as ``model``; where it does not fit, a FrameError
    naming each bad field, so whoever reads a peer's message says what was wrong with it."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise FrameError("; ".join(_reason(err) for err in exc.errors())) from None


def _reason(err: ErrorDetails) -> str:
    field = ".".join(str(part) for part in err["loc"]) or "(the message)"
    if err["type"] == "missing":
        return f"field {field!r} is missing"
    shown = repr(err["input"])
    shown = shown if len(shown) <= 60 else f"{shown[:57]}..."
    return f"field {field!r}: {err['msg']} (got {shown})"


class ErrorInfo(BaseModel):
    """What an ERROR frame says: a machine-readable code and a message for people."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    code: str
    message: str


def encode_error(code: str, message: str) -> bytes:
    return encode_json(ErrorInfo(code=code, message=message).model_dump())


def decode_error(payload: bytes) -> ErrorInfo:
    """The ERROR's code and message; a FrameError where it is not ``{code, message}``."""
    return validated(ErrorInfo, decode_json(payload))
