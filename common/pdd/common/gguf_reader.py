"""A GGUF reader that checks every count and size in the header against the file's length.

Why not the ``gguf`` package's ``GGUFReader``: it believes the header. A 52-byte file
whose metadata array claims 2^40 elements makes it loop 2^40 times, making a numpy view
per element (about 700 bytes each) of bytes the file does not have: 13 GB in two
minutes. Here every count is checked against the bytes the file has left before
anything is allocated or looped over (an element takes at least its item size, a string
at least its 8-byte length), so such a header is a ``GGUFError`` naming the field, the
size it claims and the bytes there are, at once. What a valid file costs is bounded by
its size: numeric arrays and tensors are views of the memory-mapped file, strings are
decoded once.

Refused as llama.cpp refuses them (``gguf_init_from_file``): nested arrays, tensor names
of 64 bytes or more, more than 4 dimensions, unknown tensor types, rows that are not a
multiple of the type's block, an alignment that is not a power of two; tensor data that
lies outside the file, or off the alignment, too. Big-endian files (no model in use is
one) are refused by name.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class GGUFError(ValueError):
    """A GGUF file this system cannot serve; the message says why and what would work."""


MAGIC = b"GGUF"
VERSIONS = (2, 3)
#: magic, version, tensor count, metadata count.
HEADER_BYTES = 24
#: The least a metadata entry takes: the key's length, the value's type, a 1-byte value.
MIN_KV_BYTES = 8 + 4 + 1
#: The least a tensor's header entry takes: name length, dimension count, type, offset.
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
#: The GGUF specification's bound on a metadata key.
MAX_KEY_BYTES = 65_535
#: ggml's GGML_MAX_NAME (a name must be shorter) and GGML_MAX_DIMS.
MAX_TENSOR_NAME_BYTES = 63
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

_STRING, _ARRAY = 8, 9
#: GGUF value type -> (name, struct / numpy type character).
_SCALARS = {
    0: ("uint8", "B"), 1: ("int8", "b"), 2: ("uint16", "H"), 3: ("int16", "h"),
    4: ("uint32", "I"), 5: ("int32", "i"), 6: ("float32", "f"), 7: ("bool", "?"),
    10: ("uint64", "Q"), 11: ("int64", "q"), 12: ("float64", "d"),
}  # fmt: skip
#: Tensor types read as typed arrays; the others as bytes, a row per block run.
_TYPED_TENSORS = {"F32": "<f4", "F16": "<f2", "F64": "<f8",
                  "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's header entry and its data, a view of the mapped file."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the row length first
    data: np.ndarray


@dataclass(frozen=True)
class GGUFContents:
    """Metadata (strings, numbers, lists of strings, numeric arrays as numpy views) and
    tensors, in file order."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]


def read_gguf(path: str | Path) -> GGUFContents:
    """The file's metadata and tensors; GGUFError (naming the file and the field) where
    its header is damaged or hostile."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size < HEADER_BYTES:
            raise GGUFError(f"{size} bytes cannot hold a GGUF header ({HEADER_BYTES} bytes)")
        with path.open("rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return _parse(_Cursor(buf))
    except (GGUFError, OSError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from None


class _Cursor:
    """A position in the mapped file that never moves past its end."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def need(self, nbytes: int, what: str) -> None:
        """GGUFError unless ``nbytes`` remain (checked before a count's loop, too)."""
        if nbytes > self.left:
            raise GGUFError(f"{what} needs {_size(nbytes)}; the file has {_size(self.left)} left")

    def take(self, nbytes: int, what: str) -> int:
        """Where ``nbytes`` start, the cursor moved past them."""
        self.need(nbytes, what)
        start = self.pos
        self.pos += nbytes
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from("<" + fmt, self.buf, start)[0]

    def string(self, what: str, limit: int | None = None) -> str:
        length = self.unpack("Q", f"{what}'s length")
        if limit is not None and length > limit:
            raise GGUFError(f"{what} is {length} bytes long; the most allowed is {limit}")
        start = self.take(length, f"{what}: a string of {length} bytes")
        try:
            return self.buf[start : start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} is not valid UTF-8") from None


def _parse(cur: _Cursor) -> GGUFContents:
    if cur.buf[:4] != MAGIC:
        raise GGUFError(f"not a GGUF file (it starts with {cur.buf[:4]!r}, not {MAGIC!r})")
    cur.pos = 4
    version = cur.unpack("I", "the version")
    if version & 0xFFFF == 0:
        raise GGUFError("a big-endian GGUF file; only little-endian ones are supported")
    if version not in VERSIONS:
        raise GGUFError(f"GGUF version {version} is not supported (versions 2 and 3 are)")
    tensor_count = cur.unpack("Q", "the tensor count")
    kv_count = cur.unpack("Q", "the metadata count")
    fields = _metadata(cur, kv_count)
    cur.need(
        tensor_count * MIN_TENSOR_INFO_BYTES,
        f"the tensor count {tensor_count} ({MIN_TENSOR_INFO_BYTES} bytes each at least)",
    )
    infos = [_tensor_info(cur, i) for i in range(tensor_count)]
    names = {info.name for info in infos}
    if len(names) < len(infos):
        raise GGUFError("two tensors have the same name")
    alignment = _alignment(fields)
    data_offset = cur.pos + (-cur.pos % alignment)
    tensors = [_tensor(cur, info, data_offset, alignment) for info in infos]
    return GGUFContents(fields, tensors)


def _metadata(cur: _Cursor, count: int) -> dict[str, Any]:
    cur.need(
        count * MIN_KV_BYTES, f"the metadata count {count} ({MIN_KV_BYTES} bytes each at least)"
    )
    fields: dict[str, Any] = {}
    for i in range(count):
        key = cur.string(f"metadata key {i}", MAX_KEY_BYTES)
        if key in fields:
            raise GGUFError(f"metadata key {key!r} appears twice")
        kind = cur.unpack("I", f"metadata key {key!r}'s type")
        fields[key] = _value(cur, kind, f"metadata key {key!r}")
    return fields


def _value(cur: _Cursor, kind: int, what: str) -> Any:
    if kind == _STRING:
        return cur.string(what)
    if kind in _SCALARS:
        return cur.unpack(_SCALARS[kind][1], what)
    if kind != _ARRAY:
        raise GGUFError(f"{what} has unknown value type {kind}")
    item = cur.unpack("I", f"{what}'s array type")
    count = cur.unpack("Q", f"{what}'s array length")
    if item == _STRING:
        cur.need(count * 8, f"{what}: array of {count} strings (8 bytes each at least)")
        return [cur.string(f"{what}[{i}]") for i in range(count)]
    if item == _ARRAY:
        raise GGUFError(f"{what} is an array of arrays; GGUF readers (llama.cpp) refuse those")
    if item not in _SCALARS:
        raise GGUFError(f"{what} is an array of unknown value type {item}")
    name, char = _SCALARS[item]
    dtype = np.dtype("<" + char)
    start = cur.take(count * dtype.itemsize, f"{what}: array of {count} {name} elements")
    return np.frombuffer(cur.buf, dtype=dtype, count=count, offset=start)


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    offset: int


def _tensor_info(cur: _Cursor, index: int) -> _TensorInfo:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = cur.string(f"tensor {index}'s name", MAX_TENSOR_NAME_BYTES)
    what = f"tensor {name!r}"
    dims = cur.unpack("I", f"{what}'s dimension count")
    if not 1 <= dims <= MAX_DIMS:
        raise GGUFError(f"{what} has {dims} dimensions; 1 to {MAX_DIMS} are allowed")
    shape = tuple(cur.unpack("Q", f"{what}'s shape") for _ in range(dims))
    raw_type = cur.unpack("I", f"{what}'s type")
    offset = cur.unpack("Q", f"{what}'s offset")
    if raw_type not in GGML_QUANT_SIZES:  # keyed by an IntEnum: an int finds its member
        raise GGUFError(f"{what} has unknown tensor type {raw_type}")
    tensor_type = GGMLQuantizationType(raw_type)
    block = GGML_QUANT_SIZES[tensor_type][0]
    if shape[0] % block:
        raise GGUFError(
            f"{what} ({tensor_type.name}) has rows of {shape[0]} values, not a multiple of "
            f"its block of {block}"
        )
    return _TensorInfo(name, shape, tensor_type, offset)


def _alignment(fields: dict[str, Any]) -> int:
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment {alignment!r} is not a power of two")
    return alignment


def _tensor(cur: _Cursor, info: _TensorInfo, data_offset: int, alignment: int) -> GGUFTensor:
    from gguf.constants import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[info.tensor_type]
    nbytes = math.prod(info.shape) // block * type_size
    what = f"tensor {info.name!r} ({info.tensor_type.name}, shape {list(info.shape)})"
    if info.offset % alignment:
        raise GGUFError(f"{what} starts at {info.offset}, off the {alignment}-byte alignment")
    start = data_offset + info.offset
    left = max(0, cur.size - start)
    if nbytes > left:
        raise GGUFError(
            f"{what} needs {_size(nbytes)} at data offset {info.offset}; the file has "
            f"{_size(left)} there"
        )
    data = np.frombuffer(cur.buf, dtype=np.uint8, count=nbytes, offset=min(start, cur.size))
    rows = tuple(reversed(info.shape))
    typed = _TYPED_TENSORS.get(info.tensor_type.name)
    if typed is not None:
        data = data.view(typed).reshape(rows)
    else:
        data = data.reshape(*rows[:-1], rows[-1] // block * type_size)
    return GGUFTensor(info.name, info.tensor_type, info.shape, data)


def _size(nbytes: int) -> str:
    """Bytes in words: ``12 bytes``, ``4.4 TB``."""
    if nbytes < 1000:
        return f"{nbytes} bytes"
    scaled = float(nbytes)
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        scaled /= 1000
        if scaled < 1000:
            return f"{scaled:.1f} {unit}"
    return f"{scaled / 1000:.1f} EB"
