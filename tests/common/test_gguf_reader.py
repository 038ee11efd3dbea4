"""Hostile GGUF headers: every count and size is checked against the file's length first.

Each file claims more than it holds (an array of 2^40 elements in 52 bytes, a string of
2^62 bytes, 2^40 tensors...). The reader must say which field claims what, and how
many bytes the file has, having allocated next to nothing: the work is bounded by the
file, not by the header. The ``gguf`` package's reader, which these replace, looped
over such counts (13 GB in two minutes for the 52-byte file).
"""

from __future__ import annotations

import re
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pdd.common.gguf_file import GGUFError, GGUFModelFile
from pdd.common.gguf_reader import read_gguf
from pdd.testing.gguf_files import (
    ARRAY,
    F32,
    STRING,
    UINT8,
    UINT32,
    gguf_array,
    gguf_kv,
    gguf_string,
    gguf_tensor_info,
    raw_gguf,
)

pytestmark = pytest.mark.unit

#: What reading a hostile header may allocate at most: a few small objects, never a
#: structure sized by the claim (the old reader took 45 MB on the 2^16-element array).
PEAK_BYTES = 256 * 1024

ARCH = gguf_kv("general.architecture", STRING, gguf_string("llama"))
BIG = 2**40

HOSTILE = {
    "array length": (
        raw_gguf([gguf_kv("x", ARRAY, gguf_array(UINT8, 2**16))], tail=b"abc"),
        "metadata key 'x': array of 65536 uint8 elements needs 65.5 kB; the file has 3 bytes left",
    ),
    "string length": (
        raw_gguf([gguf_kv("general.name", STRING, gguf_string("abcd", length=2**62))]),
        "metadata key 'general.name': a string of 4611686018427387904 bytes needs 4.6 EB; "
        "the file has 4 bytes left",
    ),
    "string array length": (
        raw_gguf([gguf_kv("tokens", ARRAY, gguf_array(STRING, BIG))]),
        "metadata key 'tokens': array of 1099511627776 strings (8 bytes each at least) "
        "needs 8.8 TB; the file has 0 bytes left",
    ),
    "metadata count": (
        raw_gguf([ARCH], kv_count=BIG),
        "the metadata count 1099511627776 (13 bytes each at least) needs 14.3 TB; the file "
        f"has {len(ARCH)} bytes left",
    ),
    "tensor count": (
        raw_gguf([ARCH], tensor_count=BIG),
        "the tensor count 1099511627776 (24 bytes each at least) needs 26.4 TB; the file "
        "has 0 bytes left",
    ),
    "nested arrays": (
        raw_gguf([gguf_kv("x", ARRAY, gguf_array(ARRAY, 2**16))]),
        "metadata key 'x' is an array of arrays; GGUF readers (llama.cpp) refuse those",
    ),
    "key length": (
        raw_gguf([gguf_string("k", length=BIG) + bytes(8)]),
        "metadata key 0 is 1099511627776 bytes long; the most allowed is 65535",
    ),
    "dimension count": (
        raw_gguf([ARCH], [gguf_string("w") + struct.pack("<I", 2**31) + bytes(16)]),
        "tensor 'w' has 2147483648 dimensions; 1 to 4 are allowed",
    ),
    "tensor size": (
        raw_gguf([ARCH], [gguf_tensor_info("w", [2**32, 2**32], F32, 0)]),
        "tensor 'w' (F32, shape [4294967296, 4294967296]) needs 73.8 EB at data offset 0; "
        "the file has 0 bytes there",
    ),
    "tensor offset": (
        raw_gguf([ARCH], [gguf_tensor_info("w", [8], F32, BIG)], tail=bytes(64)),
        "tensor 'w' (F32, shape [8]) needs 32 bytes at data offset 1099511627776; the file "
        "has 0 bytes there",
    ),
    "tensor name length": (
        raw_gguf([ARCH], [gguf_tensor_info("w" * 64, [8], F32, 0)]),
        "tensor 0's name is 64 bytes long; the most allowed is 63",
    ),
    "tensor type": (
        raw_gguf([ARCH], [gguf_tensor_info("w", [8], 999, 0)]),
        "tensor 'w' has unknown tensor type 999",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_header_is_a_clear_error_from_bounded_work(case: str, tmp_path: Path) -> None:
    data, message = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError) as caught:
            GGUFModelFile(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(caught.value) == f"{path} is not a readable GGUF file: {message}"
    assert peak < PEAK_BYTES


def test_the_reported_52_byte_file_names_the_key_and_what_it_claims(tmp_path: Path) -> None:
    path = tmp_path / "evil.gguf"
    path.write_bytes(raw_gguf([gguf_kv("x", ARRAY, gguf_array(UINT32, BIG))], tail=b"abc"))
    assert path.stat().st_size == 52
    with pytest.raises(GGUFError, match=re.escape(
        "metadata key 'x': array of 1099511627776 uint32 elements needs 4.4 TB; the file has "
        "3 bytes left"
    )):  # fmt: skip
        GGUFModelFile(path)


@pytest.mark.parametrize("size", [0, 4, 23])
def test_a_file_too_short_for_a_header_says_so(size: int, tmp_path: Path) -> None:
    path = tmp_path / "short.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00"[:size].ljust(size, b"\0"))
    with pytest.raises(GGUFError, match=f"{size} bytes cannot hold a GGUF header"):
        read_gguf(path)


def test_a_well_formed_file_reads_values_and_tensors_as_views(tmp_path: Path) -> None:
    weights = np.arange(8, dtype=np.float32)
    metadata = [
        ARCH,
        gguf_kv("tokens", ARRAY, gguf_array(STRING, 2, gguf_string("a") + gguf_string("bé"))),
        gguf_kv("types", ARRAY, gguf_array(UINT32, 2, struct.pack("<2I", 1, 3))),
    ]
    header = raw_gguf(metadata, [gguf_tensor_info("w", [8], F32, 0)])
    path = tmp_path / "ok.gguf"
    path.write_bytes(header + bytes(-len(header) % 32) + weights.tobytes())
    contents = read_gguf(path)
    assert contents.fields["general.architecture"] == "llama"
    assert contents.fields["tokens"] == ["a", "bé"]
    assert contents.fields["types"].tolist() == [1, 3]
    (tensor,) = contents.tensors
    assert (tensor.name, tensor.tensor_type.name, tensor.shape) == ("w", "F32", (8,))
    assert tensor.data.tolist() == weights.tolist()


def layered_model(block_count: int, **hparams: int) -> bytes:
    """A llama header with one layer's worth of tensor names (data none: never read)."""
    metadata = [ARCH, gguf_kv("llama.block_count", 10, struct.pack("<Q", block_count))]
    metadata += [gguf_kv(f"llama.{k}", UINT32, struct.pack("<I", v)) for k, v in hparams.items()]
    return raw_gguf(metadata, [gguf_tensor_info("blk.0.attn_norm.weight", [0], F32, 0)])


HPARAMS = {"attention.head_count": 2, "embedding_length": 8, "feed_forward_length": 16,
           "context_length": 64}  # fmt: skip


def test_more_layers_than_the_tensors_name_is_refused_before_any_is_built(tmp_path) -> None:
    path = tmp_path / "layers.gguf"
    path.write_bytes(layered_model(BIG, **HPARAMS))
    with pytest.raises(GGUFError, match=r"metadata says 1099511627776 layers .* of 1 layers"):
        GGUFModelFile(path).hf_config()
    path.write_bytes(layered_model(1, **HPARAMS))
    assert GGUFModelFile(path).hf_config()["num_hidden_layers"] == 1


def test_a_missing_hyper_parameter_is_named(tmp_path: Path) -> None:
    path = tmp_path / "no-heads.gguf"
    path.write_bytes(layered_model(1, embedding_length=8))
    with pytest.raises(GGUFError, match=r"'llama\.attention\.head_count' must be a positive"):
        GGUFModelFile(path).hf_config()
