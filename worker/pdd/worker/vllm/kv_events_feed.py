"""The worker's end of vLLM's KV events: a zmq SUB socket, drained when the router polls.

vLLM's engine core publishes ``KVEventBatch``es (msgpack; frames: topic, an 8-byte
sequence number, the batch) on a PUB socket it binds at ``KVEventsConfig.endpoint``.
The worker connects before vLLM starts (zmq reconnects until the engine core binds),
so nothing stored after the start is missed. Nothing runs in the background: the
router's poll of ``/v1/pdd/cache-events`` drains the socket without blocking
(``VllmEngine.drain_cache_events``), and zmq's queue holds what comes in between. A gap
in the sequence numbers (zmq dropped batches past its high-water mark) is counted as
dropped events, which makes the cache feed tell the router to rebuild its view.

Each event is renamed into the router's hash chain by ``kv_events.RouterChains``.
Blocks the router's plain token hash cannot name are left out here: a LoRA's, those
with extra keys (multimodal input, a cache salt), an offload tier's (``medium`` other
than vLLM's own ``GPU`` pool) and KV cache groups past the first.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import zmq
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from pdd.common.cache_events import CacheEvent
from pdd.worker.vllm.kv_events import RouterChains

#: Batches zmq keeps for the worker between two polls of the router (then it drops).
RECEIVE_HWM = 100_000


class VllmKVEventFeed:
    """vLLM's KV events for one engine, as the router's cache events."""

    def __init__(self, endpoint: str, topic: str, router_block_size: int) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.connect(endpoint)
        self._endpoint = endpoint
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._chains = RouterChains(router_block_size)
        self._next_seq: int | None = None
        #: Batches lost between vLLM and here (sequence gaps).
        self.num_dropped = 0

    def drain(self) -> list[CacheEvent]:
        """Every batch received since the last drain, renamed; never blocks."""
        events: list[CacheEvent] = []
        while True:
            try:
                _, seq_bytes, payload = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return events
            self._count_gap(int.from_bytes(seq_bytes, "big", signed=True))
            for event in self._decoder.decode(payload).events:
                events.extend(self._rename(event))

    def _count_gap(self, seq: int) -> None:
        if self._next_seq is not None and seq > self._next_seq:
            self.num_dropped += seq - self._next_seq
        self._next_seq = seq + 1

    def _rename(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> list[CacheEvent]:
        if isinstance(event, AllBlocksCleared):
            return self._chains.cleared()
        if not _own_pool(event.medium, event.group_idx):
            return []
        if isinstance(event, BlockRemoved):
            return self._chains.removed(event.block_hashes)
        if event.lora_name is not None or event.lora_id is not None or _has_extra_keys(event):
            return []
        return self._chains.stored(
            event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
        )

    @property
    def num_unknown_parents(self) -> int:
        return self._chains.num_unknown_parents

    def close(self) -> None:
        """Disconnect, and remove the worker's own ``ipc://`` socket file (vLLM's engine
        core, which bound it, is gone by now and leaves it behind)."""
        self._socket.close(linger=0)
        self._context.term()
        if self._endpoint.startswith("ipc://"):
            Path(self._endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


def _own_pool(medium: str | None, group_idx: int | None) -> bool:
    """The scheduler's own prefix cache, first KV cache group: what a prompt hits."""
    return medium in (None, MEDIUM_GPU) and group_idx in (None, 0)


def _has_extra_keys(event: BlockStored) -> bool:
    return any(event.extra_keys or ())
