"""One request's KV held by the vLLM worker process, token by token, between vLLM and the line.

vLLM computes and stores KV in its engine core's process; the roles move it over PDD's
channels from the worker's process. In between, a request's KV is held here as PDD's
per-token tensor ``[layers, 2, tokens, kv_heads, head_dim]``, which offers what
``pdd.worker.engine.kv_transfer`` needs of a KV cache (``layout``, ``device``,
``read_tokens``, ``write_tokens``; the block table is ignored: one request, one tensor).
So the chunks are read and written by the pdd engine's own ``encode_chunk`` and
``import_chunk``, with every check and codec, on both sides of the bridge:

- P: the connector's exact chunks come in (``import_chunk``), and the role's chunks, in
  the receiver's codec and range, go out (``encode_chunk``).
- RLD, MD: the line's chunks come in (``import_chunk``: gaps, digests, codecs as on the
  pdd engine), and one exact chunk goes to the connector when the request is submitted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from pdd.common.kv_codec import NO_CODEC, KVCodec
from pdd.worker.engine.kv_transfer import encode_chunk, import_chunk
from pdd.worker.model.kv_cache import KVLayout


class TokenKV:
    """The KV of one request's first ``held`` tokens (see the module's docstring)."""

    def __init__(
        self, layout: KVLayout, fingerprint: str, token_ids: Sequence[int], held: int = 0
    ) -> None:
        """``token_ids``: the tokens whose KV may be held (the prompt); ``held``: a
        prefix held elsewhere (the receiver's prefix cache): chunks continue after it,
        and its KV is not here (``start``)."""
        self.layout = layout
        self.device = torch.device("cpu")
        self.fingerprint = fingerprint
        self.token_ids = list(token_ids)
        self.start = self.held = held
        shape = (layout.num_layers, 2, len(token_ids), layout.num_kv_heads, layout.head_dim)
        self._data = torch.empty(shape, dtype=layout.dtype)

    def read_tokens(self, _table: Sequence[int], start: int, end: int) -> torch.Tensor:
        return self._data[:, :, start:end]

    def write_tokens(self, _table: Sequence[int], start: int, data: torch.Tensor) -> None:
        self._data[:, :, start : start + data.shape[2]] = data.to(self.layout.dtype)

    def take(self, chunk: bytes, codec: KVCodec = NO_CODEC) -> int:
        """Import one chunk (``kv_transfer.import_chunk``: its checks and errors, a gap's
        ``KVGapError`` included); returns the tokens now held."""
        self.held = import_chunk(
            self, [], self.token_ids, self.held, chunk, self.fingerprint, codec
        )
        return self.held

    def chunks(
        self, start: int, end: int, chunk_tokens: int, codec: KVCodec = NO_CODEC
    ) -> Iterator[bytes]:
        """``[start, end)`` of the held KV as chunks of at most ``chunk_tokens``, coded by
        ``codec``; ValueError past what is held."""
        if not self.start <= start <= end <= self.held:
            raise ValueError(f"KV [{start}, {end}) asked for; [{self.start}, {self.held}) is held")
        for a in range(start, end, max(1, chunk_tokens)):
            b = min(a + chunk_tokens, end)
            data = self._data[:, :, a:b]
            yield encode_chunk(data, a, self.fingerprint, self.token_ids[:b], codec)
