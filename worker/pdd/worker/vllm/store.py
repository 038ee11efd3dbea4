"""Where the vLLM connector's KV chunks wait between instances: a small interface and a
folder behind it.

A chunk is PDD's KV wire chunk (``pdd.worker.engine.kv_transfer``), self-describing and
checked on import, so the store only keeps bytes in order under a request key. The
interface is what PDD's data-plane channels implement next (P pushes a request's chunks
to RLD and MD as it computes them); the folder serves one machine and the tests: vLLM
runs its model in a process of its own, so an in-memory store would not reach it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Protocol

#: A request key names a folder: letters, digits, dot, dash and underscore only.
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SUFFIX = ".kv"


class BadKeyError(ValueError):
    """A request key the store cannot use as a name."""


class KVStore(Protocol):
    """An ordered stream of KV chunks per request key."""

    def put(self, key: str, chunk: bytes) -> None:
        """Append one chunk to ``key``'s stream."""
        ...

    def chunks(self, key: str, skip: int = 0) -> list[bytes]:
        """Every chunk of ``key`` so far past the first ``skip``, in the order they were put."""
        ...


def check_key(key: str) -> str:
    """``key``, or BadKeyError saying what a key may hold."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise BadKeyError(
            f"KV store key {key!r} is not 1-128 letters, digits, '.', '-' or '_' "
            "(starting with a letter or digit)"
        )
    return key


class DirectoryKVStore:
    """Chunks as files ``ROOT/KEY/NNNNNN.kv``, each written whole before it is named, so a
    reader in another process never sees half a chunk."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def put(self, key: str, chunk: bytes) -> None:
        folder = self.root / check_key(key)
        folder.mkdir(parents=True, exist_ok=True)
        seq = sum(1 for p in folder.iterdir() if p.suffix == _SUFFIX)
        final = folder / f"{seq:06d}{_SUFFIX}"
        partial = folder / f".{final.name}.{os.getpid()}"
        partial.write_bytes(chunk)
        partial.rename(final)

    def chunks(self, key: str, skip: int = 0) -> list[bytes]:
        folder = self.root / check_key(key)
        if not folder.is_dir():
            return []
        return [p.read_bytes() for p in sorted(folder.glob(f"*{_SUFFIX}"))[skip:]]

    def drop(self, key: str) -> None:
        """Forget ``key``'s chunks (a request released or done with)."""
        shutil.rmtree(self.root / check_key(key), ignore_errors=True)
