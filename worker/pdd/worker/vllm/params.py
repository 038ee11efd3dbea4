"""What a request tells the PDD connector, in vLLM's ``kv_transfer_params``: export its
prompt's KV, or import the KV of its first tokens. No vLLM import, so the worker and the
tests build these without it.

- P (and a relay's source): ``export_params(key, codec)``: every prompt token's KV goes
  to the store under ``key`` as it is computed, as PDD chunks coded by ``codec``.
- RLD and MD: ``import_params(key, tokens, codec)``: the KV of the prompt's first
  ``tokens`` tokens comes from ``key``, past what this instance's prefix cache holds.
  For a handoff the prompt is P's prompt plus the token IDs decoded elsewhere and
  ``tokens`` is P's prompt length: the instance computes only the handed-over IDs.
  ``start``: the store holds the KV from this token on, the instance's prefix cache
  being expected to hold what is before it (the hit it answered); where it no longer
  does, nothing is imported and the request is computed in full.

vLLM carries them as ``SamplingParams(extra_args={"kv_transfer_params": ...})``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdd.common.kv_codec import NO_CODEC, KVCodec, parse_kv_codec
from pdd.worker.vllm.store import check_key

EXPORT = "pdd_export"
IMPORT = "pdd_import"


class BadTransferParamsError(ValueError):
    """``kv_transfer_params`` that name a PDD transfer but cannot be one."""


@dataclass(frozen=True)
class Transfer:
    """One request's KV move: its store key, codec and, for an import, how many tokens."""

    key: str
    codec: KVCodec = NO_CODEC
    tokens: int = 0
    start: int = 0


def export_params(key: str, codec: KVCodec = NO_CODEC) -> dict[str, Any]:
    """``kv_transfer_params`` that export a prompt's KV under ``key``."""
    return {EXPORT: {"key": check_key(key), "codec": parse_kv_codec(codec)}}


def import_params(
    key: str, tokens: int, codec: KVCodec = NO_CODEC, start: int = 0
) -> dict[str, Any]:
    """``kv_transfer_params`` that import the KV of a prompt's first ``tokens`` tokens,
    stored from token ``start`` on (the prefix cache holding those before it)."""
    if not isinstance(tokens, int) or tokens < 1:
        raise BadTransferParamsError(f"an import needs tokens >= 1, got {tokens!r}")
    if not isinstance(start, int) or not 0 <= start < tokens:
        raise BadTransferParamsError(f"an import starts in [0, {tokens}), got {start!r}")
    entry = {"key": check_key(key), "tokens": tokens, "codec": parse_kv_codec(codec)}
    return {IMPORT: {**entry, "start": start} if start else entry}


def parse(params: dict[str, Any] | None) -> tuple[Transfer | None, Transfer | None]:
    """The export and the import a request's ``kv_transfer_params`` ask for (either None).

    Raises BadTransferParamsError for a PDD entry that is not one ``*_params`` makes."""
    if not params:
        return None, None
    return _transfer(params.get(EXPORT), EXPORT), _transfer(params.get(IMPORT), IMPORT)


def _transfer(entry: Any, name: str) -> Transfer | None:
    if entry is None:
        return None
    try:
        if name == EXPORT:
            built = export_params(entry["key"], entry.get("codec", NO_CODEC))
        else:
            codec = entry.get("codec", NO_CODEC)
            built = import_params(entry["key"], entry["tokens"], codec, entry.get("start", 0))
    except (TypeError, KeyError, ValueError) as exc:
        raise BadTransferParamsError(f"kv_transfer_params[{name!r}] = {entry!r}: {exc}") from exc
    return Transfer(**built[name])
