"""``pdd worker --engine vllm --role mono``: vLLM's AsyncLLM behind the worker API the
router speaks, on the real SmolLM2-135M-Instruct (float32, greedy), called as the router
calls it (``pdd.router.worker_client.WorkerClient``):

- ``/health`` names engine vllm and what vLLM got; ``/load`` counts what runs;
- two prompts at once stream the same tokens as vLLM offline (``offline.generate_all``,
  the reference ``pdd generate --engine vllm`` runs), the prefix-cache fact on seq 0;
- a cancel (what the router sends when its client goes away) ends the request here;
- the router's prefix index, fed from the worker's cache events (vLLM's KV events,
  renamed into the router's blocks) and rounded to the block ``/health`` names, predicts
  the prefix vLLM then reports cached, also for a prompt leaving vLLM's block mid-way;
- SIGTERM drains: ``/ready`` turns false, the running request streams to its end, the
  process exits 0 (a worker of its own: the tests run in any order).

Two worker processes (one shared) and one offline vLLM. Slow; skipped without vLLM (the
``pdd[vllm]`` extra) or without the pulled model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import httpx
import pytest

from .conftest import MAX_TOKENS, VLLM_ENV, VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pdd.common.tokenizer import HFTokenizer
from pdd.common.wire import Endpoint, PipelinePlan, SamplingSpec, TokenEvent
from pdd.local.cluster import HOST, free_port
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig, reusable
from pdd.router.worker_client import WorkerClient
from pdd.testing.processes import process_group_members
from pdd.testing.waiting import until, until_sync
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.vllm.engine_args import VllmEngineSettings
from pdd.worker.vllm.offline import generate_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SECRET = "vllm-worker-secret"
MAX_MODEL_LEN, BLOCK_SIZE, MAX_NUM_SEQS = 2048, 32, 4
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Explain, step by step, how a hash map handles collisions with open addressing and "
    "with separate chaining, and compare their memory use.",
)


class Worker:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def answers_ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
        try:
            return httpx.get(f"{self.url}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture(scope="module")
def prompts(model: Path) -> list[list[int]]:
    tokenizer = HFTokenizer(model / "tokenizer.json", ())
    return [tokenizer.encode(text) for text in PROMPTS]


def start_worker(model: Path, log: Path) -> Worker:
    """``pdd worker --engine vllm --role mono`` on the model, in a session of its own
    (``stop_worker`` ends vLLM's engine core with it)."""
    http, data = free_port(), free_port()
    argv = [sys.executable, "-m", "pdd.cli", "worker", "--engine", "vllm", "--role", "mono"]
    argv += ["--instance-id", "vm", "--model", str(model), "--dtype", "float32"]
    argv += ["--enforce-eager", "--max-num-seqs", str(MAX_NUM_SEQS)]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE)]
    argv += ["--http", f"{HOST}:{http}", "--data", f"{HOST}:{data}", "--drain-notice-seconds", "0"]
    env = {**os.environ, **VLLM_ENV, "PDD_SHARED_SECRET": SECRET}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Worker(proc, f"http://{HOST}:{http}", log)


def stop_worker(worker: Worker) -> None:
    with suppress(ProcessLookupError):
        os.killpg(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait(30)


@pytest.fixture(scope="module")
def worker(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """The vLLM worker the tests share, started first: the reference runs while it starts."""
    started = start_worker(model, tmp_path_factory.mktemp("vllm-worker") / "worker.log")
    try:
        yield started
    finally:
        stop_worker(started)


@pytest.fixture(scope="module")
def reference(worker: Worker, model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """vLLM offline's greedy tokens for the prompts (the same settings as the worker)."""
    settings = VllmEngineSettings(
        model=str(model), dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=512, enforce_eager=True, seed=0,
    )  # fmt: skip
    saved = {k: os.environ.get(k) for k in VLLM_ENV}
    os.environ.update(VLLM_ENV)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS)
        return [r.token_ids for r in generate_all(settings, prompts, params)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def ready(worker: Worker) -> Worker:
    until_sync(worker.answers_ready, "the vLLM worker's /ready", timeout_s=900)
    return worker


def plan(rid: str, prompt: list[int], **sampling: object) -> PipelinePlan:
    spec = SamplingSpec(max_tokens=MAX_TOKENS, **sampling)  # type: ignore[arg-type]
    main = Endpoint(instance_id="vm", http_url="http://vm", fast_addr="vm:9000", wan_addr="vm:9000")
    return PipelinePlan(
        request_id=rid, prompt_ids=prompt, sampling=spec, pipeline="mono", main=main
    )


async def run_request(client: WorkerClient, url: str, p: PipelinePlan) -> list[TokenEvent]:
    await client.start(url, p)
    return [event async for event in client.stream(url, p.request_id)]


async def test_health_names_engine_vllm_and_what_it_got(ready: Worker) -> None:
    client = WorkerClient(SECRET)
    try:
        health = await client.health(ready.url)
        load = await client.load(ready.url)
    finally:
        await client.aclose()
    assert health.role == "mono" and health.endpoint.instance_id == "vm"
    engine = health.engine
    assert (engine.engine, engine.dtype, engine.block_size) == ("vllm", "float32", BLOCK_SIZE)
    assert engine.max_running_requests == MAX_NUM_SEQS and engine.max_model_len == MAX_MODEL_LEN
    assert engine.kv_blocks * engine.block_size == engine.kv_tokens > 0
    assert (load.running, load.waiting, load.capacity) == (0, 0, MAX_NUM_SEQS)
    assert load.kv_blocks_free == load.kv_blocks_total == engine.kv_blocks


async def test_streams_equal_vllm_offline(
    ready: Worker, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    client = WorkerClient(SECRET, timeout_s=120)
    try:
        runs = await asyncio.gather(
            *(run_request(client, ready.url, plan(f"eq-{i}", p)) for i, p in enumerate(prompts))
        )
    finally:
        await client.aclose()
    for events, expected in zip(runs, reference, strict=True):
        assert [e.error for e in events if e.error] == []
        tokens = {e.seq: e.token_id for e in events if e.token_id is not None}
        assert [tokens[i] for i in range(len(tokens))] == expected
        assert events[-1].finished and events[-1].finish_reason in ("stop", "length")
        assert events[0].seq == 0 and events[0].cached_tokens is not None


async def test_a_cancel_ends_the_request_here(ready: Worker, prompts: list[list[int]]) -> None:
    client = WorkerClient(SECRET, timeout_s=120)
    p = plan("cancel-1", prompts[1], ignore_eos=True)
    p = p.model_copy(update={"sampling": p.sampling.model_copy(update={"max_tokens": 1500})})
    seen: list[TokenEvent] = []
    try:
        await client.start(ready.url, p)
        async for event in client.stream(ready.url, p.request_id):
            seen.append(event)
            if len(seen) == 2:
                assert (await client.load(ready.url)).running == 1
                await client.cancel(ready.url, p.request_id)
        load = await client.load(ready.url)
        state = httpx.get(
            f"{ready.url}/v1/pdd/debug/state", headers={"Authorization": f"Bearer {SECRET}"}
        ).json()
    finally:
        await client.aclose()
    assert not any(e.finished for e in seen) and len(seen) < 1500
    assert (load.running, load.waiting) == (0, 0)
    assert (state["live_requests"], state["engine_requests"]) == (0, 0)


async def test_sigterm_drains_then_exits(
    model: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    own = start_worker(model, tmp_path / "worker.log")  # this test ends its worker
    client = WorkerClient(SECRET, timeout_s=120)
    p = plan("drain-1", prompts[0], ignore_eos=True)
    events: list[TokenEvent] = []
    try:
        await asyncio.to_thread(until_sync, own.answers_ready, "/ready", 900)
        await client.start(own.url, p)
        async for event in client.stream(own.url, p.request_id):
            events.append(event)
            if len(events) == 1:
                own.proc.send_signal(signal.SIGTERM)
                await until(lambda: not own.answers_ready(), "/ready false after SIGTERM")
        assert [e.seq for e in events if e.token_id is not None][-1] == MAX_TOKENS - 1
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert await asyncio.to_thread(own.proc.wait, 120) == 0
    finally:
        await client.aclose()
        stop_worker(own)


class RouterView:
    """The router's prefix index of the worker, fed as the router feeds it: pages of
    ``/v1/pdd/cache-events`` from a cursor, a reset rebuilding the instance's view; a hit
    rounded to the cache block its ``/health`` names, as the router's dispatcher rounds it."""

    def __init__(self, client: WorkerClient, url: str, cache_block: int) -> None:
        self.client, self.url, self.cursor = client, url, 0
        self.index = PrefixIndex(PrefixIndexConfig())  # the router's default: blocks of 16
        self.cache_block = cache_block

    async def predicted_hit(self, prompt: list[int]) -> int:
        page = await self.client.cache_events(self.url, self.cursor)
        if page.reset:
            self.index.forget_instance("vm")
        self.index.apply_all("vm", page.events)
        self.cursor = page.next_cursor
        hits = self.index.match(self.index.hashes(prompt))
        return reusable(hits, lambda _: self.cache_block).get("vm", 0)


def one_token(rid: str, prompt: list[int]) -> PipelinePlan:
    p = plan(rid, prompt)
    return p.model_copy(update={"sampling": p.sampling.model_copy(update={"max_tokens": 1})})


async def test_the_router_predicts_the_prefix_vllm_holds(
    ready: Worker, prompts: list[list[int]]
) -> None:
    """vLLM's KV events (blocks of 32) reach the router's index (blocks of 16) renamed: after
    a prompt, the index predicts for that prompt plus a continuation exactly the prompt
    tokens vLLM then reports cached (its full blocks of the prompt); and for a prompt that
    leaves it inside vLLM's second block, after 3 router blocks, vLLM's one block of 32
    (the router's blocks alone said 48)."""
    prompt = prompts[1] * 3 + prompts[0]  # 3 blocks of 32 and a partial one, or more
    extended = [*prompt, 28, 1690, 30]
    held = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    assert held >= 2 * BLOCK_SIZE and len(prompt) % BLOCK_SIZE
    router_block = PrefixIndexConfig().block_size
    leaves = 3 * router_block
    assert BLOCK_SIZE < leaves < 2 * BLOCK_SIZE
    diverged = [*prompt[:leaves], *(t + 1 for t in prompt[leaves:])]
    client = WorkerClient(SECRET, timeout_s=120)
    try:
        view = RouterView(client, ready.url, (await client.health(ready.url)).engine.block_size)
        first = await run_request(client, ready.url, one_token("kv-events-1", prompt))
        assert [e.error for e in first if e.error] == []

        async def all_blocks_seen() -> int | None:  # vLLM publishes after its step
            hit = await view.predicted_hit(extended)
            return hit if hit >= held else None

        predicted = await until(all_blocks_seen, "the index holds the prompt's blocks", 120, 0.05)
        again = await run_request(client, ready.url, one_token("kv-events-2", extended))
        predicted_diverged = await view.predicted_hit(diverged)
        other = await run_request(client, ready.url, one_token("kv-events-3", diverged))
    finally:
        await client.aclose()
    assert again[0].seq == 0 and again[0].cached_tokens == held
    assert predicted == held
    assert other[0].seq == 0 and other[0].cached_tokens == BLOCK_SIZE
    assert predicted_diverged == BLOCK_SIZE


def test_the_router_serves_a_chat_through_the_vllm_worker(
    ready: Worker, model: Path, tmp_path: Path
) -> None:
    """``pdd router`` with the vLLM worker as its mono instance, asked as a client asks."""
    port = free_port()
    argv = [sys.executable, "-m", "pdd.cli", "router", "--model", str(model)]
    argv += ["--host", HOST, "--port", str(port), "--mono", f"vm={ready.url}"]
    argv += ["--poll-interval-s", "0.2"]
    router = Worker(
        subprocess.Popen(
            argv, stdout=(tmp_path / "router.log").open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "PDD_SHARED_SECRET": SECRET}, start_new_session=True,
        ),
        f"http://{HOST}:{port}",
        tmp_path / "router.log",
    )  # fmt: skip
    try:
        until_sync(router.answers_ready, "the router's /ready")
        body = {
            "model": model.name,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        answer = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=300)
    finally:
        stop_worker(router)
    assert answer.status_code == 200, answer.text
    assert "Paris" in answer.json()["choices"][0]["message"]["content"]
    assert answer.headers["x-pdd-pipeline"] == "mono"


def test_sigterm_while_vllm_starts_leaves_no_engine_core(model: Path, tmp_path: Path) -> None:
    """A worker stopped while vLLM loads (a pod deleted, ``pdd up`` giving up on
    readiness) takes vLLM's engine core process down with it, and leaves no socket file."""
    own = start_worker(model, tmp_path / "worker.log")
    try:
        until_sync(
            lambda: len(process_group_members(own.proc.pid)) > 1 or own.answers_ready(),
            "vLLM's engine core started",
        )
        own.proc.send_signal(signal.SIGTERM)
        own.proc.wait(120)
        until_sync(lambda: not process_group_members(own.proc.pid), "the worker's processes gone")
        # Nor the ipc socket of vLLM's KV events (named by the worker's PID).
        assert not Path(tempfile.gettempdir(), f"pdd-vllm-kv-events-{own.proc.pid}").exists()
    finally:
        stop_worker(own)
