"""One prompt through vLLM offline, with the PDD connector's moves: what
``pdd generate --engine vllm`` runs, so that ``pdd generate`` is the reference for both
engines and the command line does P's export and MD's import by hand.

vLLM is imported only when a prompt runs (``generate``); without it that is a
``VllmNotInstalledError`` naming the extra. What an import may claim is read from the
store here, without vLLM: the exported prefix (``exported_prefix``), which the prompt
must start with (``import_transfer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdd.worker.engine.kv_transfer import KVTransferError, decode_chunk, prefix_digest
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.vllm.engine_args import VllmEngineSettings, engine_kwargs
from pdd.worker.vllm.params import import_params
from pdd.worker.vllm.sampling import vllm_sampling_kwargs
from pdd.worker.vllm.store import DirectoryKVStore

INSTALL_HINT = "pip install -e '.[vllm]'"


class VllmNotInstalledError(RuntimeError):
    """vLLM, the ``pdd[vllm]`` extra, is not installed."""


class KVImportError(ValueError):
    """What a store holds under a key cannot be imported for this prompt."""


@dataclass(frozen=True)
class OfflineResult:
    """vLLM's answer to one prompt: the generated IDs, the prompt tokens it did not
    compute (``num_cached_tokens``: its prefix cache plus the connector's import) and
    the connector's report (``kv_transfer_params``: ``pdd_exported_tokens``,
    ``pdd_imported_tokens``)."""

    token_ids: list[int]
    num_cached_tokens: int
    kv_transfer_params: dict[str, Any] | None


def exported_prefix(store_dir: Path | str, key: str) -> tuple[int, str]:
    """How many leading tokens' KV ``key`` holds (its chunks from token 0 on, without a
    gap) and the digest of those tokens' IDs. Raises KVImportError when it holds none."""
    end, digest = 0, ""
    for blob in DirectoryKVStore(store_dir).chunks(key):
        try:
            header, _ = decode_chunk(blob)
        except KVTransferError as exc:
            raise KVImportError(f"KV under {key!r} in {store_dir}: {exc}") from exc
        if header.start != end:
            break
        end, digest = header.end, header.prefix_digest
    if end == 0:
        raise KVImportError(f"no KV exported under {key!r} in {store_dir}")
    return end, digest


def import_transfer(store_dir: Path | str, key: str, prompt_ids: Sequence[int]) -> dict[str, Any]:
    """``kv_transfer_params`` importing all that ``key`` holds, for a prompt that starts
    with the exported tokens (MD's: P's prompt plus handed-over IDs)."""
    tokens, digest = exported_prefix(store_dir, key)
    if len(prompt_ids) < tokens or prefix_digest(prompt_ids[:tokens]) != digest:
        raise KVImportError(
            f"the prompt does not start with the {tokens} tokens exported under {key!r}: "
            "pass the exporting prompt's IDs, then the handed-over ones"
        )
    return import_params(key, tokens)


def generate(
    settings: VllmEngineSettings,
    prompt_ids: list[int],
    params: SamplingParams,
    kv_transfer_params: dict[str, Any] | None = None,
) -> OfflineResult:
    """Start vLLM with ``settings``, run ``prompt_ids`` sampled as ``params`` asks (the
    pdd engine's parameters, checked there), stop vLLM."""
    return generate_all(settings, [prompt_ids], params, kv_transfer_params)[0]


def generate_all(
    settings: VllmEngineSettings,
    prompts: list[list[int]],
    params: SamplingParams,
    kv_transfer_params: dict[str, Any] | None = None,
) -> list[OfflineResult]:
    """``generate`` for several prompts in one vLLM start (a reference for many)."""
    try:
        import vllm
    except ImportError as exc:
        raise VllmNotInstalledError(
            f"--engine vllm needs vLLM, the pdd[vllm] extra: {INSTALL_HINT}"
        ) from exc
    sampling = vllm.SamplingParams(**vllm_sampling_kwargs(params, kv_transfer_params))
    llm = vllm.LLM(**engine_kwargs(settings))
    try:
        inputs = [{"prompt_token_ids": ids} for ids in prompts]
        outs = llm.generate(inputs, sampling, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return [
        OfflineResult(
            list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0), out.kv_transfer_params
        )
        for out in outs
    ]
