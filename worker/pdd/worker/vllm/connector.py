"""PDD's KV connector for vLLM (v1 KV connector API): PDD's three moves with vLLM inside.

Loaded by vLLM from its configuration::

    KVTransferConfig(kv_connector="PDDConnector",
                     kv_connector_module_path="pdd.worker.vllm.connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"store_dir": DIR})

and steered per request by ``kv_transfer_params`` (``pdd.worker.vllm.params``):

- **export** (P): each step, the prompt KV the step computed (P's own prefix hit at once)
  leaves as PDD chunks (``kv_transfer.encode_chunk``, coded by the request's codec).
- **import** (RLD, MD): the KV of the prompt's first ``tokens`` tokens that this
  instance's prefix cache lacks is written into the request's blocks before vLLM
  computes it (``kv_transfer.import_chunk``: the same checks of model, dtype, layout,
  codec, token digest and range as the pdd engine's import).
- **handoff** (MD): the prompt is P's prompt plus the token IDs a relay decoded, and
  ``tokens`` is P's prompt length: vLLM is told that many tokens are matched, so it
  computes only the handed-over IDs, in one pass, and decodes on.

vLLM's blocks are read and written as per-token KV by ``paged_view.VllmPagedKV``, so the
chunk format, the codecs and their checks are the pdd engine's own, not a copy. A chunk
holds every layer of a token range, so the KV is moved per step (saved after the
forward, in ``wait_for_save``; loaded whole before vLLM schedules the request), not per
layer: the pdd engine's P ships at the same grain. The chunks wait in a
``store.KVStore`` (a folder now; PDD's data-plane channels next).

Loads are asynchronous, as vLLM's own remote connectors' are: ``get_num_new_matched_tokens``
answers ``(n, True)``, so vLLM allocates the request's blocks and parks it
(``WAITING_FOR_REMOTE_KVS``) while the other requests step on; the load runs on a
worker thread (``load_pool.LoadPool``) and ``get_finished`` reports it done, after which
vLLM schedules the request from its loaded tokens. A load is tried once per request: a
request vLLM asks about again (preempted, or recomputing after a failed load) is
computed in full.

A load that fails (a chunk refused by ``import_chunk``'s checks, or missing) reports the
blocks it left without KV through ``get_block_ids_with_load_errors`` with its finish.
vLLM's ``kv_load_failure_policy`` decides what follows; PDD keeps vLLM's default,
``fail``: the request ends with vLLM's finish reason ``error`` (an abort to PDD's roles,
``serving``), the engine and its other requests go on. A request aborted while its load
runs has the load cancelled before its next chunk; vLLM frees its blocks once the load
reports.

Saves stay synchronous: ``wait_for_save`` reads each step's KV before vLLM may free or
reuse its blocks; an asynchronous save would have to hold them (``request_finished``'s
delay) and report through ``finished_sending``, for a read that is a copy of what the
step just wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm import _custom_ops as ops
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from pdd.common.kv_codec import KVCodec
from pdd.worker.engine.kv_transfer import KVTransferError, encode_chunk, import_chunk
from pdd.worker.model.config import ModelConfig
from pdd.worker.model.errors import UnsupportedArchitectureError
from pdd.worker.vllm import params
from pdd.worker.vllm.load_pool import LoadPool
from pdd.worker.vllm.paged_view import VllmPagedKV, probe_block_layout
from pdd.worker.vllm.store import DirectoryKVStore, KVStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: Tokens per exported chunk, as the pdd engine's ``export_kv`` default.
DEFAULT_CHUNK_TOKENS = 256
#: Threads that run loads (``load_threads``): file reads and decodes overlap the forward;
#: more than a few would take cores from it.
DEFAULT_LOAD_THREADS = 2


@dataclass(frozen=True)
class LoadItem:
    """Import the KV of ``token_ids`` past the ``held`` tokens into ``block_ids``."""

    request_id: str
    key: str
    codec: KVCodec
    token_ids: list[int]
    held: int
    block_ids: list[int]


@dataclass(frozen=True)
class SaveItem:
    """Export the KV of tokens ``[start, end)`` of the sequence in ``block_ids``."""

    key: str
    codec: KVCodec
    token_ids: list[int]  # [0, end)
    block_ids: list[int]
    start: int
    end: int


@dataclass
class PDDConnectorMetadata(KVConnectorMetadata):
    """One step's moves, from the scheduler to the worker."""

    loads: list[LoadItem] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)


@dataclass
class _Export:
    """A prompt being exported: where it stands (scheduler side)."""

    transfer: params.Transfer
    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    sent: int = 0


class PDDConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.get_from_extra_config
        store_dir = extra("store_dir", None)
        if not store_dir:
            raise ValueError(
                "the PDD connector needs kv_connector_extra_config={'store_dir': DIR}, "
                "the folder where instances exchange KV chunks"
            )
        self._store: KVStore = DirectoryKVStore(store_dir)
        self._chunk_tokens = int(extra("chunk_tokens", DEFAULT_CHUNK_TOKENS))
        self._block_size = vllm_config.cache_config.block_size
        self._cache_dtype = vllm_config.cache_config.cache_dtype
        self._fingerprint = model_fingerprint(vllm_config)
        # scheduler side
        self._exports: dict[str, _Export] = {}
        self._imports: dict[str, params.Transfer] = {}
        self._local_hit: dict[str, int] = {}
        self._pending_loads: dict[str, LoadItem] = {}
        self._loaded: dict[str, int] = {}
        # worker side
        self._kv: VllmPagedKV | None = None
        self._load_errors: set[int] = set()
        self._loads = (
            LoadPool(int(extra("load_threads", DEFAULT_LOAD_THREADS)))
            if role == KVConnectorRole.WORKER
            else None
        )

    # ---- scheduler side ----

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """An import's tokens past the local hit, leaving at least one token to compute
        (vLLM samples from the last computed position), loaded asynchronously."""
        export, imported = self._transfers(request)
        if export is not None:
            self._exports.setdefault(request.request_id, _Export(export, _prompt(request)))
        if imported is None:
            return 0, False
        if request.request_id in self._loaded:
            # Asked again after its load: preempted, or its load failed under the
            # recompute policy. Computed in full rather than loaded (and failing) again.
            log.warning("request %s: KV loaded once already; computing it", request.request_id)
            return 0, False
        if num_computed_tokens < imported.start:
            # The hit this instance answered was evicted meanwhile: the store lacks
            # [hit, start), so the request is computed in full, never read stale.
            log.warning(
                "request %s: the prefix cache holds %d tokens, the import starts at %d; "
                "computing it in full", request.request_id, num_computed_tokens, imported.start,
            )  # fmt: skip
            return 0, False
        self._imports[request.request_id] = imported
        self._local_hit[request.request_id] = num_computed_tokens
        matched = min(imported.tokens, len(_prompt(request)) - 1)
        external = max(0, matched - num_computed_tokens)
        return external, external > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remember a load, into the blocks vLLM just allocated, for the next step's meta."""
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        imported = self._imports[rid]
        token_ids = _prompt(request)[: imported.tokens]
        self._pending_loads[rid] = LoadItem(
            rid, imported.key, imported.codec, token_ids, self._local_hit[rid],
            list(blocks.get_block_ids()[0]),
        )  # fmt: skip
        self._loaded[rid] = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PDDConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        computed = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            blocks = list(new.block_ids[0])
            self._plan(meta, new.req_id, blocks, new.num_computed_tokens + computed[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            export = self._exports.get(rid)
            fresh = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted: its blocks are all new
                blocks = list(fresh[0]) if fresh else []
            else:
                blocks = (export.block_ids if export else []) + (list(fresh[0]) if fresh else [])
            self._plan(meta, rid, blocks, cached.num_computed_tokens[i] + computed[rid])
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its ``kv_transfer_params`` on the output say what moved.
        (A pending load stays: it leaves with this step's meta, since vLLM holds the
        blocks of a request parked for its load until the worker reports the load.)"""
        rid = request.request_id
        export = self._exports.pop(rid, None)
        for table in (self._imports, self._local_hit):
            table.pop(rid, None)
        loaded = self._loaded.pop(rid, 0)
        report: dict[str, Any] = {}
        if export is not None:
            report["pdd_exported_tokens"] = export.sent
        if loaded:
            report["pdd_imported_tokens"] = loaded
        return False, report or None

    def _plan(self, meta: PDDConnectorMetadata, rid: str, blocks: list[int], end: int) -> None:
        """Add the export a scheduled request's step computes."""
        export = self._exports.get(rid)
        if export is None:
            return
        export.block_ids = blocks
        end = min(end, len(export.prompt))
        if end > export.sent:
            transfer = export.transfer
            meta.saves.append(
                SaveItem(
                    transfer.key, transfer.codec, export.prompt[:end], blocks, export.sent, end
                )
            )
            export.sent = end

    def _transfers(self, request: Request) -> tuple[params.Transfer | None, ...]:
        try:
            return params.parse(request.kv_transfer_params)
        except params.BadTransferParamsError as exc:
            # Refused where the request is made (the worker checks); here the request
            # is computed in full rather than the engine stopping for everyone.
            log.error("request %s: %s; computing it without a KV transfer", request.request_id, exc)
            return None, None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's block packing once, by writing a probe through its own cache writer."""
        names = sorted(kv_caches, key=extract_layer_index)
        layers = [kv_caches[name] for name in names]
        first = layers[0]
        if first.device.type != "cpu" or first.dim() != 4 or self._cache_dtype != "auto":
            raise NotImplementedError(
                f"the PDD connector reads vLLM's CPU KV cache in the model's dtype; got "
                f"{tuple(first.shape)} on {first.device} with kv-cache-dtype {self._cache_dtype}"
            )
        _, kv_heads, block_size, width = first.shape
        if block_size != self._block_size:
            raise NotImplementedError(
                f"vLLM's kernel blocks hold {block_size} tokens, its scheduler's {self._block_size}"
            )
        isa = _get_attn_isa(first.dtype, block_size, width // 2, self._cache_dtype)

        def write(key, value, key_cache, value_cache, slots) -> None:
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

        layout = probe_block_layout(write, kv_heads, block_size, width // 2, first.dtype)
        self._kv = VllmPagedKV(layers, layout)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads on the load threads; vLLM schedules their requests
        once ``get_finished`` reports them."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDDConnectorMetadata)
        for item in meta.loads:
            self._load_pool().submit(item.request_id, partial(self._load, item))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a loading request is not in the step."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: a PDD chunk holds every layer, read in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        """Export what this step computed of each exported prompt, chunk by chunk."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDDConnectorMetadata)
        for item in meta.saves:
            for start in range(item.start, item.end, self._chunk_tokens):
                end = min(start + self._chunk_tokens, item.end)
                data = self._view().read_tokens(item.block_ids, start, end)
                blob = encode_chunk(
                    data, start, self._fingerprint, item.token_ids[:end], item.codec
                )
                self._store.put(item.key, blob)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The loads that ended (``finished_recving``), their failed blocks kept for
        ``get_block_ids_with_load_errors`` in the same step; the loads of requests that
        finished meanwhile are cancelled first."""
        loads = self._load_pool()
        loads.cancel(finished_req_ids)
        ended = loads.collect()
        self._load_errors |= ended.failed_blocks
        return None, ended.request_ids or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def shutdown(self) -> None:
        """Cancel the running loads and wait for their threads, so none writes into a
        KV cache vLLM is releasing."""
        if self._loads is not None:
            self._loads.shutdown()

    def _load(self, item: LoadItem, cancelled: threading.Event) -> set[int]:
        """Import the item's chunks in order (on a load thread); the blocks left without
        KV, which vLLM then fails or recomputes. A cancelled load's request is gone: its
        blocks are not reported."""
        held, wanted = item.held, len(item.token_ids)
        for blob in self._store.chunks(item.key):
            if cancelled.is_set():
                return set()
            if held >= wanted:
                break
            try:
                held = import_chunk(
                    self._view(), item.block_ids, item.token_ids, held, blob,
                    self._fingerprint, item.codec,
                )  # fmt: skip
            except KVTransferError as exc:
                log.error("KV chunk of %s refused: %s", item.key, exc)
                break
        if held >= wanted or cancelled.is_set():
            return set()
        first, last = held // self._block_size, (wanted - 1) // self._block_size
        return set(item.block_ids[first : last + 1])

    def _load_pool(self) -> LoadPool:
        if self._loads is None:
            raise RuntimeError("the PDD connector's scheduler side runs no loads")
        return self._loads

    def _view(self) -> VllmPagedKV:
        if self._kv is None:
            raise RuntimeError("the PDD connector moved KV before vLLM registered its KV caches")
        return self._kv


def model_fingerprint(vllm_config: VllmConfig) -> str:
    """The fingerprint the pdd engine stamps on the same checkpoint's KV (config.json and
    folder name), so chunks check alike whichever engine made them; for an architecture
    the pdd engine does not run, a hash of vLLM's view of the config."""
    model = vllm_config.model_config.model
    config_file = Path(model) / "config.json"
    config = (
        json.loads(config_file.read_text())
        if config_file.is_file()
        else vllm_config.model_config.hf_config.to_dict()
    )
    try:
        return ModelConfig.from_hf_dict(config, name=Path(model).name).fingerprint()
    except UnsupportedArchitectureError:
        blob = json.dumps({"name": model, "config": config}, sort_keys=True, default=str)
        return "vllm-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def _prompt(request: Request) -> list[int]:
    return list(request.prompt_token_ids or [])
