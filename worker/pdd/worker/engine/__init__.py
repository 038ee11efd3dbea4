"""The inference core: one ``Engine`` per model and device (see docs/engine.md).

Its public API is the ``Engine`` class and the types its methods take and return,
all importable from here. Inside: ``scheduler`` (who computes how many tokens this
step), ``request`` (a request's state and limits) and ``request_table`` (the live
ones), ``sampling``, ``block_pool`` with ``prefix_cache`` / ``radix_cache`` (which KV
blocks hold what), ``handoff`` (the KV and token-ID handoff API the engine delegates
to), ``kv_transfer`` (the KV chunk wire format of a handoff), ``kv_budget`` (how many
KV blocks an engine gets) and ``config``. The forward pass it drives is
``pdd.worker.model``.
"""

from pdd.worker.engine.config import EngineConfig, EngineConfigError, EngineStats
from pdd.worker.engine.engine import Engine
from pdd.worker.engine.kv_transfer import KVTransferError
from pdd.worker.engine.request import (
    FinishReason,
    InvalidRequestStateError,
    NoFreeBlocksError,
    PromptTooLongError,
    RequestError,
    RequestOutput,
    RequestTooLargeError,
    UnknownRequestError,
)
from pdd.worker.engine.sampling import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineStats",
    "FinishReason",
    "InvalidRequestStateError",
    "KVTransferError",
    "NoFreeBlocksError",
    "PromptTooLongError",
    "RequestError",
    "RequestOutput",
    "RequestTooLargeError",
    "SamplingParams",
    "UnknownRequestError",
]
