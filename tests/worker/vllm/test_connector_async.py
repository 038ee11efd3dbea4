"""The PDD connector's asynchronous loads (pdd.worker.vllm.connector, load_pool), on the real
SmolLM2-135M-Instruct in float32, greedy, with vLLM's engine core in this process so the
test steps it and holds a load:

- while one request's load is held (its store's ``chunks`` blocks until the test
  releases it), a request already in vLLM decodes to its end; the held request then
  loads and answers token-equal to vLLM alone;
- a load whose chunks are missing ends the request with finish reason ``error`` (vLLM's
  ``kv_load_failure_policy`` default, ``fail``, which PDD keeps), once, and the engine
  serves on;
- a request aborted while its load is held: the load is cancelled (no chunk imported),
  vLLM keeps the blocks until the load reports, then frees them all.

The store is ``DirectoryKVStore`` behind a gate (``GatedStore``); the test waits on the
gate's conditions, never on the clock. On a synchronous connector the first test fails:
the step that carries the held load blocks until the gate gives up (``HOLD_LIMIT_S``).

Slow; skipped without vLLM (the ``pdd[vllm]`` extra) or without the pulled model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import VLLM_ENV, VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

import vllm
import vllm.envs

from pdd.worker.vllm import connector
from pdd.worker.vllm.engine_args import VllmEngineSettings, engine_kwargs
from pdd.worker.vllm.params import export_params, import_params
from pdd.worker.vllm.store import DirectoryKVStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

MAX_TOKENS = 12
#: How long a held ``chunks`` call waits before it gives up and counts as timed out: a
#: bound for a connector that loads in vLLM's step (and so can never be released), not
#: a synchronisation; generous, for a loaded two-core machine.
HOLD_LIMIT_S = 600.0
TEXTS = [
    "Explain how a hash map handles collisions with open addressing and with separate "
    "chaining, compare their memory use and their behaviour as the load factor grows, and "
    "say which one you would pick for a cache of short-lived session objects and why.",
    "Write a packing list for a three-day walking trip through cold hills with little "
    "mobile coverage and water sources fifteen kilometres apart, grouped by purpose, with "
    "a one-line reason for each item and the three items never to leave behind.",
]


class Gate:
    """Holds the store's reads of chosen keys until released; says who is waiting."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: set[str] = set()
        self._waiting: set[str] = set()
        self.timed_out: set[str] = set()
        self.reads: dict[str, int] = {}

    def hold(self, key: str) -> None:
        with self._cond:
            self._held.add(key)

    def release(self, key: str) -> None:
        with self._cond:
            self._held.discard(key)
            self._cond.notify_all()

    def pass_through(self, key: str) -> None:
        """Called by the store: wait while ``key`` is held (at most ``HOLD_LIMIT_S``)."""
        with self._cond:
            self.reads[key] = self.reads.get(key, 0) + 1
            self._waiting.add(key)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: key not in self._held, HOLD_LIMIT_S):
                self.timed_out.add(key)
            self._waiting.discard(key)
            self._cond.notify_all()

    def wait_until_waiting(self, key: str) -> bool:
        """True once a read of ``key`` waits at the gate."""
        with self._cond:
            return self._cond.wait_for(lambda: key in self._waiting, HOLD_LIMIT_S)

    def is_waiting(self, key: str) -> bool:
        with self._cond:
            return key in self._waiting

    def __repr__(self) -> str:
        return f"Gate(reads={self.reads}, waiting={self._waiting}, timed_out={self.timed_out})"


GATE = Gate()


class GatedStore(DirectoryKVStore):
    """The connector's folder store, its reads passing ``GATE`` first."""

    def chunks(self, key: str, skip: int = 0) -> list[bytes]:
        GATE.pass_through(key)
        return super().chunks(key, skip)


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One vLLM instance, engine core in this process, its store gated; each prompt's
    answer alone, then its KV exported, then the prefix cache emptied."""
    patch = pytest.MonkeyPatch()
    for name, value in {**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        patch.setenv(name, value)
    patch.setattr(connector, "DirectoryKVStore", GatedStore)
    imported: list[int] = []  # the ``held`` of each chunk import_chunk took

    def counting_import(*args: Any, **kwargs: Any) -> int:
        imported.append(args[3])
        return connector_import(*args, **kwargs)

    connector_import = connector.import_chunk
    patch.setattr(connector, "import_chunk", counting_import)
    settings = VllmEngineSettings(
        model=str(model), dtype="float32", block_size=32, max_model_len=512, max_num_seqs=4,
        enable_prefix_caching=True, seed=0, kv_store_dir=tmp_path_factory.mktemp("kv-store"),
    )  # fmt: skip
    llm = vllm.LLM(**engine_kwargs(settings))
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
        alone = [_tokens(o) for o in llm.generate(_inputs(prompts), [_params()] * len(prompts))]
        keys = [f"async-{i}" for i in range(len(prompts))]
        exports = [_params({"kv_transfer_params": export_params(k)}, 1) for k in keys]
        llm.generate(_inputs(prompts), exports)
        assert llm.reset_prefix_cache()
        yield {"llm": llm, "prompts": prompts, "alone": alone, "keys": keys, "imported": imported}
    finally:
        llm.llm_engine.engine_core.shutdown()
        vllm.envs.disable_envs_cache()  # the in-process engine core cached os.environ
        patch.undo()


def test_a_request_decodes_while_another_loads(engine: dict[str, Any]) -> None:
    llm, prompts, alone, keys = engine["llm"], engine["prompts"], engine["alone"], engine["keys"]
    loop = llm.llm_engine
    GATE.hold(keys[0])
    loop.add_request("loading", {"prompt_token_ids": prompts[0]}, _import(keys[0], prompts[0]))
    loop.add_request("running", {"prompt_token_ids": prompts[1]}, _params())
    loop.step()  # parks "loading" and starts its load, prefills "running"
    assert GATE.wait_until_waiting(keys[0]), GATE
    outputs = _step_until(loop, lambda out: "running" in out and out["running"].finished)
    # The held load is still waiting at the gate: "running" decoded all its tokens meanwhile.
    assert GATE.is_waiting(keys[0]) and keys[0] not in GATE.timed_out, GATE
    assert _tokens(outputs["running"]) == alone[1]
    assert "loading" not in outputs or not outputs["loading"].outputs[0].token_ids
    GATE.release(keys[0])
    outputs = _step_until(loop, lambda out: "loading" in out and out["loading"].finished)
    loaded = outputs["loading"]
    assert keys[0] not in GATE.timed_out
    assert loaded.kv_transfer_params == {"pdd_imported_tokens": len(prompts[0]) - 1}
    assert len(prompts[0]) - loaded.num_cached_tokens == 1
    assert _tokens(loaded) == alone[0]


def test_a_failed_load_ends_its_request_with_an_error_once(engine: dict[str, Any]) -> None:
    llm, prompts, alone = engine["llm"], engine["prompts"], engine["alone"]
    loop = llm.llm_engine
    scheduler = loop.engine_core.engine_core.scheduler
    assert llm.reset_prefix_cache()
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    loop.add_request("missing", {"prompt_token_ids": prompts[0]}, _import("absent", prompts[0]))
    loop.add_request("fine", {"prompt_token_ids": prompts[1]}, _params())
    outputs = _step_until(loop, lambda out: not scheduler.requests)
    assert GATE.reads["absent"] == 1
    assert outputs["missing"].outputs[0].finish_reason == "error"
    assert outputs["missing"].outputs[0].token_ids == []
    assert _tokens(outputs["fine"]) == alone[1]
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_an_abort_cancels_a_held_load_and_frees_its_blocks(engine: dict[str, Any]) -> None:
    llm, prompts, alone, keys = engine["llm"], engine["prompts"], engine["alone"], engine["keys"]
    loop = llm.llm_engine
    scheduler = loop.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    assert llm.reset_prefix_cache()
    free = pool.get_num_free_blocks()
    imports_before = len(engine["imported"])
    GATE.hold(keys[1])
    # vLLM's scheduler knows the request by the internal ID add_request returns.
    internal = loop.add_request(
        "aborted", {"prompt_token_ids": prompts[1]}, _import(keys[1], prompts[1])
    )
    loop.step()
    assert GATE.wait_until_waiting(keys[1]), GATE
    loop.abort_request(["aborted"])
    loop.step()  # the abort reaches the worker, which cancels the load
    # The load may still write: vLLM keeps the request's blocks until it reports.
    assert internal in scheduler.requests
    assert pool.get_num_free_blocks() < free
    GATE.release(keys[1])
    _step_until(loop, lambda out: internal not in scheduler.requests)
    assert len(engine["imported"]) == imports_before  # cancelled before its first chunk
    assert pool.get_num_free_blocks() == free
    # The engine serves on: the same prompt, imported now, answers as vLLM alone.
    loop.add_request("after", {"prompt_token_ids": prompts[1]}, _import(keys[1], prompts[1]))
    outputs = _step_until(loop, lambda out: "after" in out and out["after"].finished)
    assert _tokens(outputs["after"]) == alone[1]
    assert keys[1] not in GATE.timed_out


def _step_until(loop: Any, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Step vLLM until ``done(outputs)``, outputs being each request's latest output. No
    bound of its own: how many steps a load thread takes depends on the machine (a step
    with nothing to run is quick), so the module's pytest timeout stops a hang."""
    outputs: dict[str, Any] = {}
    while not done(outputs):
        for out in loop.step():
            outputs[out.request_id] = out
    return outputs


def _import(key: str, prompt: list[int]) -> vllm.SamplingParams:
    return _params({"kv_transfer_params": import_params(key, len(prompt))})


def _params(
    extra: dict[str, Any] | None = None, max_tokens: int = MAX_TOKENS
) -> vllm.SamplingParams:
    """Greedy sampling of ``max_tokens`` ids, the connector's move in ``extra``."""
    return vllm.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
        extra_args=extra,
    )  # fmt: skip


def _inputs(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": ids} for ids in prompts]


def _tokens(output: Any) -> list[int]:
    return list(output.outputs[0].token_ids)
