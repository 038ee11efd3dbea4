"""The vLLM worker's engine seam (``pdd.worker.vllm.serving``) under the real mono role and
control API, with a scripted stand-in for vLLM's ``AsyncLLM``: what the router sees
(streams, load, cancels, refusals) comes out of the same role code as on the pdd engine.
No vLLM needed; the real engine is ``test_vllm_worker.py``'s.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdd.common.block_hash import block_hashes
from pdd.common.cache_events import BlockStored
from pdd.common.wire import (
    REQUEST_FAILED_ERROR_TYPE,
    Endpoint,
    EngineInfo,
    GuidedDecoding,
    PipelinePlan,
    SamplingSpec,
    TokenEvent,
)
from pdd.local.probes import flatten
from pdd.router.worker_client import WorkerCallError, WorkerClient
from pdd.testing.asgi import StreamingASGITransport
from pdd.testing.waiting import until
from pdd.worker import server
from pdd.worker.instance import WorkerInstance
from pdd.worker.options import WorkerOptions
from pdd.worker.roles.base import WorkerSettings
from pdd.worker.vllm.kv_events import RouterChains
from pdd.worker.vllm.serving import KVUsage, VllmEngine, VllmRunner
from pdd.worker.vllm.worker_config import (
    DEFAULT_KV_BYTES,
    VllmWorkerConfigError,
    vllm_settings,
)

pytestmark = pytest.mark.unit

SECRET, URL = "s", "http://vllm-mono:8000"
INFO = EngineInfo(
    engine="vllm", device="cpu", dtype="float32", block_size=16, kv_blocks=64, kv_tokens=1024,
    kv_bytes=1 << 20, max_running_requests=4, max_model_len=64, max_prompt_tokens=63,
    max_num_batched_tokens=64,
)  # fmt: skip
ENDPOINT = Endpoint(instance_id="vm", http_url=URL, fast_addr="vm:9000", wan_addr="vm:9000")


class ScriptedLLM:
    """``AsyncLLM.generate`` yielding what the test feeds each request, and recording
    which requests vLLM would have aborted (their generator was cancelled)."""

    errored = False

    def __init__(self) -> None:
        self.feeds: dict[str, asyncio.Queue[Any]] = {}
        self.aborted: list[str] = []
        self.prompts: dict[str, Any] = {}

    def feed(
        self, rid: str, tokens: list[int], finish: str | None = None, cached: int = 0,
        queued_ts: float = 0.0, scheduled_ts: float = 0.0,
    ) -> None:  # fmt: skip
        completion = SimpleNamespace(token_ids=tokens, finish_reason=finish)
        stats = SimpleNamespace(queued_ts=queued_ts, scheduled_ts=scheduled_ts)
        out = SimpleNamespace(outputs=[completion], finished=finish is not None,
                              num_cached_tokens=cached, metrics=stats)  # fmt: skip
        self.feeds.setdefault(rid, asyncio.Queue()).put_nowait(out)

    def fail(self, rid: str, exc: Exception) -> None:
        self.feeds.setdefault(rid, asyncio.Queue()).put_nowait(exc)

    async def generate(self, prompt: Any, sampling: Any, rid: str) -> AsyncIterator[Any]:
        self.prompts[rid] = (prompt, sampling)
        feed = self.feeds.setdefault(rid, asyncio.Queue())
        try:
            while True:
                out = await feed.get()
                if isinstance(out, Exception):
                    raise out
                yield out
                if out.finished:
                    return
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise

    def shutdown(self) -> None:
        pass


class EventFeed:
    """Stands in for ``VllmKVEventFeed``: vLLM's blocks renamed by the real ``RouterChains``."""

    def __init__(self) -> None:
        self.chains, self.pending, self.num_dropped = RouterChains(16), [], 0

    def store(self, vllm_hash: bytes, parent: bytes | None, tokens: list[int]) -> None:
        self.pending += self.chains.stored([vllm_hash], parent, tokens, len(tokens))

    def drain(self) -> list[Any]:
        events, self.pending = self.pending, []
        return events


class Harness:
    def __init__(self, feed: EventFeed | None = None) -> None:
        self.llm = ScriptedLLM()
        engine = VllmEngine(self.llm, INFO, KVUsage(), dict, feed)  # type: ignore[arg-type]
        runner = VllmRunner(engine, asyncio.get_running_loop())
        settings = WorkerSettings(
            role="mono", instance_id="vm", secret=SECRET, http="vllm-mono:8000",
            advertise_fast="vm:9000", advertise_wan="vm:9000",
        )  # fmt: skip
        self.worker = WorkerInstance(settings, runner)
        transport = StreamingASGITransport({"vllm-mono:8000": self.worker.app})
        self.client = WorkerClient(SECRET, transport=transport)

    async def events(self, rid: str) -> list[TokenEvent]:
        return [e async for e in self.client.stream(URL, rid)]


def plan(rid: str, prompt: list[int] | None = None, **sampling: Any) -> PipelinePlan:
    return PipelinePlan(
        request_id=rid, prompt_ids=prompt or [1, 2, 3], pipeline="mono", main=ENDPOINT,
        sampling=SamplingSpec(max_tokens=3, **sampling),
    )  # fmt: skip


async def test_a_request_streams_vllms_deltas_as_the_mono_role_does() -> None:
    h = Harness()
    await h.client.start(URL, plan("r1", temperature=0.0, repetition_penalty=1.1))
    assert (await h.client.load(URL)).waiting == 1  # admitted, nothing computed yet
    h.llm.feed("r1", [5, 6], cached=2)
    await until(lambda: h.worker.role.runner.snapshot.stats.num_running == 1, "running")
    h.llm.feed("r1", [7], finish="length")
    events = await h.events("r1")
    assert [(e.seq, e.token_id) for e in events if not e.finished] == [(0, 5), (1, 6)]
    assert (events[-1].seq, events[-1].token_id, events[-1].finish_reason) == (2, 7, "length")
    assert events[0].cached_tokens == 2 and events[1].cached_tokens is None
    prompt, sampling = h.llm.prompts["r1"]
    assert prompt == {"prompt_token_ids": [1, 2, 3]}
    assert (sampling["max_tokens"], sampling["repetition_penalty"]) == (3, 1.1)
    load = await h.client.load(URL)
    assert (load.running, load.waiting, load.kv_blocks_free) == (0, 0, INFO.kv_blocks)
    assert (await h.client.health(URL)).engine.engine == "vllm"


async def test_vllms_queue_time_is_observed_once_per_request() -> None:
    """vLLM's own QUEUED and SCHEDULED stamps (on every output it yields) give the
    worker's ``pdd_worker_request_queue_time_seconds`` one observation per request."""
    h = Harness()
    await h.client.start(URL, plan("r1"))
    h.llm.feed("r1", [5], queued_ts=10.0, scheduled_ts=12.5)
    h.llm.feed("r1", [6, 7], finish="length", queued_ts=10.0, scheduled_ts=12.5)
    await h.events("r1")
    samples = flatten(h.worker.role.metrics.render().decode())
    name = 'pdd_worker_request_queue_time_seconds_{}{{role="mono"}}'
    assert (samples[name.format("count")], samples[name.format("sum")]) == (1.0, 2.5)


async def test_vllms_kv_events_reach_the_router_as_cache_events() -> None:
    feed = EventFeed()
    h = Harness(feed)
    feed.store(b"v0", None, list(range(32)))
    page = await h.client.cache_events(URL, 0)
    assert page.events == [
        BlockStored(block_hashes=block_hashes(list(range(32)), 16), parent_hash=None,
                    block_size=16)
    ]  # fmt: skip
    seen = page.next_cursor  # the router is current
    feed.store(b"v1", b"v0", list(range(32, 64)))
    feed.num_dropped = 3  # zmq lost batches: a view from before them is rebuilt
    page = await h.client.cache_events(URL, seen)
    # Both kept events again, and the cursor past the one the lost batches took.
    assert page.reset and page.next_cursor == 3 and len(page.events) == 2


async def test_a_cancel_aborts_the_vllm_request_and_frees_its_seat() -> None:
    h = Harness()
    await h.client.start(URL, plan("r1"))
    h.llm.feed("r1", [5])
    await until(lambda: h.worker.role.runner.snapshot.stats.num_running == 1, "running")
    await h.client.cancel(URL, "r1")
    await until(lambda: h.llm.aborted == ["r1"], "vLLM's generate cancelled")
    events = await h.events("r1")
    assert not any(e.finished for e in events)
    load = await h.client.load(URL)
    assert (load.running, load.waiting) == (0, 0) and not h.worker.role.live


async def test_a_failed_vllm_request_ends_its_stream_with_the_error() -> None:
    h = Harness()
    await h.client.start(URL, plan("r1"))
    h.llm.fail("r1", RuntimeError("engine core gone"))
    events = await h.events("r1")
    assert events[-1].error_type == REQUEST_FAILED_ERROR_TYPE
    assert "engine core gone" in (events[-1].error or "")
    assert not h.worker.role.live


@pytest.mark.parametrize(
    ("request_plan", "reason"),
    [
        (plan("g", guided=GuidedDecoding(kind="json_object")), "grammar"),
        (plan("l", logprobs=2), "logprobs"),
        (plan("t", prompt=list(range(64))), "at most 63"),
    ],
    ids=["grammar", "logprobs", "prompt-too-long"],
)
async def test_what_vllm_cannot_serve_is_refused_with_a_reason(
    request_plan: PipelinePlan, reason: str
) -> None:
    h = Harness()
    with pytest.raises(WorkerCallError) as refused:
        await h.client.start(URL, request_plan)
    assert "400" in str(refused.value) and reason in str(refused.value)
    assert not h.worker.role.live and not h.llm.prompts


def worker_args(*argv: str) -> WorkerOptions:
    base = ["--engine", "vllm", "--role", "mono", "--instance-id", "vm", "--model", "."]
    return server.parse_args([*base, *argv])


def test_worker_flags_reach_vllm_by_its_names(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = worker_args(
        "--model", str(tmp_path), "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5",
        "--max-model-len", "512", "--tensor-parallel-size", "2", "--kv-cache-dtype", "fp8",
        "--enforce-eager", "--dtype", "float32",
    )  # fmt: skip
    s = vllm_settings(args)
    assert (s.model, s.max_num_seqs, s.gpu_memory_utilization) == (str(tmp_path), 8, 0.5)
    assert (s.max_model_len, s.tensor_parallel_size, s.kv_cache_dtype) == (512, 2, "fp8")
    assert (s.enforce_eager, s.dtype, s.kv_cache_memory_bytes) == (True, "float32", None)
    sized = vllm_settings(worker_args("--model", str(tmp_path)))
    assert sized.kv_cache_memory_bytes == DEFAULT_KV_BYTES
    gib = vllm_settings(worker_args("--model", str(tmp_path), "--kv-cache-gib", "1.5"))
    assert gib.kv_cache_memory_bytes == 3 << 29
    events_at = f"ipc://{tempfile.gettempdir()}/pdd-vllm-kv-events-{os.getpid()}"
    assert sized.kv_events_endpoint == events_at  # a socket per worker process
    assert sized.kv_store_dir is None  # mono moves no KV
    for role in ("prefill", "relay", "main"):  # the connector's store: a folder per worker
        moves = vllm_settings(worker_args("--model", str(tmp_path), "--role", role))
        assert moves.kv_store_dir == f"{tempfile.gettempdir()}/pdd-vllm-kv-{os.getpid()}"
    assert args.router_block_size == 16  # the router's default, unless said otherwise


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--num-blocks", "64"], "--num-blocks is the pdd engine's"),
        (["--model", "tiny"], "runs a checkpoint directory"),
        (["--router-block-size", "0"], "--router-block-size must be positive"),
    ],
)
def test_what_engine_vllm_does_not_do_is_refused(
    tmp_path: Path, argv: list[str], reason: str
) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(VllmWorkerConfigError, match=reason):
        vllm_settings(worker_args("--model", str(tmp_path), *argv))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_worker_exits_2_naming_the_extra(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "secret").write_text("s")
    argv = ["--engine", "vllm", "--role", "mono", "--instance-id", "vm"]
    argv += ["--model", str(tmp_path), "--secret-file", str(tmp_path / "secret")]
    assert server.main(argv) == 2
    assert "pdd[vllm]" in caplog.text
