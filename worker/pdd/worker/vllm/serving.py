"""vLLM's ``AsyncLLM`` behind the worker's engine runner, so a role serves on either engine.

The roles drive an engine through ``EngineRunner``: ``call(fn)`` runs ``fn(engine)``,
``subscribe(rid, fn)`` delivers each step's ``RequestOutput`` for a request, and
``snapshot.stats`` is the load the router reads. ``VllmRunner`` is that runner over
``VllmEngine``, which offers what the mono role and the cache feed call on the pdd
engine (``add_request``, ``abort``, ``info``, ``stats``, ``drain_cache_events``) by
running each request as an ``AsyncLLM.generate`` task on the worker's event loop:
vLLM's engine core steps in processes of its own, so nothing here blocks the loop and
no engine thread is needed. Each delta vLLM yields becomes the pdd engine's
``RequestOutput``, so the role's session, stream and metrics code is the same for both.

Load is counted here: a request is waiting from ``add_request`` to its first output,
then running until it ends (vLLM's own counts come only with its steps, so they go
stale when it idles). Free KV blocks are vLLM's scheduler's (``kv_cache_usage``, read by
a stat logger; blocks cached but unreferenced count as free there, as vLLM can evict
them), and all blocks once nothing runs. Cache events are vLLM's own KV events, renamed
into the router's block hashes (``kv_events_feed``), drained when the router polls.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pdd.common.wire import REQUEST_FAILED_ERROR_TYPE, CacheEvent, EngineInfo
from pdd.worker.engine import EngineStats
from pdd.worker.engine.request import (
    FinishReason,
    PromptTooLongError,
    RequestOutput,
    UnknownRequestError,
)
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.engine_runner import EngineRunner, RunnerSnapshot, _run_all
from pdd.worker.vllm.engine_args import VllmEngineSettings, engine_kwargs
from pdd.worker.vllm.offline import INSTALL_HINT, VllmNotInstalledError
from pdd.worker.vllm.sampling import vllm_sampling_kwargs

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from pdd.worker.vllm.kv_events_feed import VllmKVEventFeed

log = logging.getLogger(__name__)
T = TypeVar("T")

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
#: How often a role waiting on vLLM between its outputs looks again (``after_next_step``).
STEP_TICK_S = 0.01


class KVUsage:
    """The share of vLLM's KV blocks in use, as its scheduler last reported it."""

    def __init__(self) -> None:
        self.fraction = 0.0

    def logger_factory(self) -> Callable[..., Any]:
        """A vLLM ``StatLoggerFactory`` whose loggers record into this."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        usage = self

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *_: Any, **__: Any):
                if scheduler_stats is not None:
                    usage.fraction = float(scheduler_stats.kv_cache_usage)

            def log_engine_initialized(self) -> None:
                pass

        return _Recorder


class VllmEngine:
    """The pdd engine's serving surface over ``AsyncLLM`` (see the module's docstring)."""

    def __init__(
        self,
        llm: AsyncLLM,
        info: EngineInfo,
        usage: KVUsage,
        sampling: Callable[[dict[str, Any]], Any],
        cache_events: VllmKVEventFeed | None = None,
    ) -> None:
        """``sampling`` makes vLLM's ``SamplingParams`` (streaming deltas) from keyword
        arguments (``vllm_sampling_kwargs``); ``cache_events`` is vLLM's KV events (None:
        the router's index knows nothing of this instance)."""
        self.llm = llm
        self._cache_events = cache_events
        self._sampling = sampling
        self._info = info
        self._usage = usage
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._waiting: set[str] = set()
        #: Where each request's outputs go (the runner's delivery); set by ``VllmRunner``.
        self.deliver: Callable[[list[RequestOutput]], None] = lambda _: None

    @property
    def max_running_requests(self) -> int:
        return self._info.max_running_requests

    def info(self) -> EngineInfo:
        return self._info

    @property
    def stats(self) -> EngineStats:
        total = self._info.kv_blocks
        used = round(self._usage.fraction * total) if self._tasks else 0
        return EngineStats(
            num_total_blocks=total,
            num_free_blocks=total - used,
            num_cached_blocks=0,
            num_locked_blocks=0,
            num_running=len(self._tasks) - len(self._waiting),
            num_waiting=len(self._waiting),
            num_awaiting_kv=0,
            num_preemptions=0,
        )

    def has_unfinished(self) -> bool:
        return bool(self._tasks)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> None:
        """Admit a request: its outputs reach ``deliver`` as vLLM yields them. A request
        vLLM cannot sample as asked, or a prompt past the context window, is refused here
        (HTTP 400), before anything runs."""
        if request_id in self._tasks:
            raise ValueError(f"request {request_id!r} is already running here")
        if len(prompt_ids) > self._info.max_prompt_tokens:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens; this instance takes at most "
                f"{self._info.max_prompt_tokens}"
            )
        self._submit(request_id, prompt_ids, params)

    def _submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """Run ``prompt_ids`` as vLLM's request ``request_id``, the connector's move (if
        any) in its ``kv_transfer_params``; refused (``VllmSamplingError``) as the
        sampling mapping refuses."""
        sampling = self._sampling(vllm_sampling_kwargs(params, kv_transfer_params))
        self._waiting.add(request_id)
        task = asyncio.get_running_loop().create_task(
            self._run(request_id, prompt_ids, sampling), name=f"vllm-{request_id}"
        )
        self._tasks[request_id] = task

    def abort(self, request_id: str) -> None:
        """Stop a request: cancelling its ``generate`` makes vLLM abort it and free its
        blocks. UnknownRequestError when it is not running here."""
        task = self._tasks.pop(request_id, None)
        if task is None:
            raise UnknownRequestError(request_id)
        self._waiting.discard(request_id)
        task.cancel()

    def drain_cache_events(self) -> list[CacheEvent]:
        return self._cache_events.drain() if self._cache_events is not None else []

    @property
    def num_dropped_cache_events(self) -> int:
        return self._cache_events.num_dropped if self._cache_events is not None else 0

    async def _run(self, rid: str, prompt_ids: list[int], sampling: Any) -> None:
        try:
            async for out in self.llm.generate({"prompt_token_ids": prompt_ids}, sampling, rid):
                first = rid in self._waiting
                self._waiting.discard(rid)
                if first:
                    self._started(rid, len(prompt_ids), int(out.num_cached_tokens or 0))
                self.deliver([_pdd_output(rid, out, first)])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one request failed; the engine serves the others
            log.warning("vLLM failed request %s: %s", rid, exc)
            error = f"engine vllm failed the request: {exc.__cause__ or exc}"
            failed = RequestOutput(
                rid, [], True, FinishReason.ABORT, error=error,
                error_type=REQUEST_FAILED_ERROR_TYPE,
            )  # fmt: skip
            self.deliver([failed])
        finally:
            if self._tasks.get(rid) is asyncio.current_task():
                del self._tasks[rid]
            self._waiting.discard(rid)
            self._ended(rid)

    def _started(self, rid: str, prompt_tokens: int, cached_tokens: int) -> None:
        """vLLM's first output of ``rid``: of its ``prompt_tokens``, ``cached_tokens`` were
        not computed (its prefix cache, or loaded by the connector)."""

    def _ended(self, rid: str) -> None:
        """vLLM is done with ``rid`` (finished, failed or cancelled): nothing to forget
        here; the roles' engine drops what it kept for the request."""

    def shutdown(self) -> None:
        """Drop what runs and stop vLLM's engine core (its processes end with it)."""
        for task in self._tasks.values():
            task.cancel()
        self.llm.shutdown()
        if self._cache_events is not None:
            self._cache_events.close()


def _pdd_output(rid: str, out: Any, first: bool) -> RequestOutput:
    """One delta of vLLM's ``RequestOutput`` as the pdd engine's: the new IDs, the finish,
    and on the first the prompt tokens vLLM did not compute (prefix cache plus import)
    and the request's queue time."""
    completion = out.outputs[0]
    reason = None
    if out.finished:
        reason = _FINISH.get(completion.finish_reason or "", FinishReason.ABORT)
    return RequestOutput(
        request_id=rid,
        new_token_ids=list(completion.token_ids),
        finished=out.finished,
        finish_reason=reason,
        num_cached_tokens=int(out.num_cached_tokens or 0) if first else 0,
        queue_time_s=_queue_time(out) if first else None,
    )


def _queue_time(out: Any) -> float | None:
    """vLLM's own queue time (``RequestStateStats``: first SCHEDULED less QUEUED, engine
    core clock, what it observes as ``vllm:request_queue_time_seconds``), carried on its
    outputs when stats are logged (our stat logger turns them on); None where it is not."""
    stats = getattr(out, "metrics", None)
    queued, scheduled = getattr(stats, "queued_ts", 0.0), getattr(stats, "scheduled_ts", 0.0)
    if not (queued and scheduled):
        return None
    return max(0.0, float(scheduled) - float(queued))


class VllmRunner(EngineRunner):
    """``EngineRunner`` over ``VllmEngine``: calls run on the event loop (awaiting what
    returns an awaitable), outputs are delivered as vLLM yields them."""

    def __init__(self, engine: VllmEngine, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(engine, loop)  # type: ignore[arg-type]  # the serving surface
        engine.deliver = self._on_outputs
        self._started = False
        self._after_step: list[tuple[Callable[[Any], Any], asyncio.Future]] = []
        self._tick: asyncio.TimerHandle | None = None

    @property
    def snapshot(self) -> RunnerSnapshot:
        """The load now: counted on the event loop, so never stale."""
        return RunnerSnapshot(stats=self.engine.stats, steps=self._steps)

    @snapshot.setter
    def snapshot(self, _: RunnerSnapshot) -> None:
        """The base class stores snapshots; this one reads the engine instead."""

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._steps += 1
        self._deliver(outputs)

    def start(self) -> None:
        self._started = True

    def stop(self) -> None:
        self._started = False
        self.engine.shutdown()  # type: ignore[attr-defined]

    @property
    def alive(self) -> bool:
        return self._started and not self.engine.llm.errored  # type: ignore[attr-defined]

    async def call(self, fn: Callable[[Any], T]) -> T:
        result = fn(self.engine)
        if inspect.isawaitable(result):
            result = await result
        return result

    def after_next_step(self, fn: Callable[[Any], T]) -> asyncio.Future[T]:
        """``fn(engine)`` once vLLM's next output arrives, or a tick passes: vLLM steps
        in its own processes and says nothing between outputs (a prefill's chunks land
        in the connector's store while no output comes), so the tick is how a role
        waiting for KV looks again."""
        future: asyncio.Future[T] = self._loop.create_future()
        self._after_step.append((fn, future))
        self._tick_soon()
        return future

    async def next_step(self) -> None:
        """Until vLLM's next output, or a tick (see ``after_next_step``)."""
        self._tick_soon()
        await super().next_step()

    def _tick_soon(self) -> None:
        if self._tick is None:
            self._tick = self._loop.call_later(STEP_TICK_S, self._turn)

    def _turn(self) -> None:
        """A turn without outputs: run the step hooks, wake the step waiters."""
        self._tick = None
        self._deliver([])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        after, self._after_step = self._after_step, []
        _run_all(self.engine, after)
        super()._deliver(outputs)


@dataclass(frozen=True)
class StartedVllm:
    """A started ``AsyncLLM`` and what an engine over it is built from."""

    llm: AsyncLLM
    info: EngineInfo
    usage: KVUsage
    sampling: Callable[[dict[str, Any]], Any]
    cache_events: VllmKVEventFeed | None


def start_engine(settings: VllmEngineSettings, router_block_size: int) -> VllmEngine:
    """``start_vllm`` wrapped for the mono role (the roles that move KV:
    ``role_engine.start_role_engine``)."""
    started = start_vllm(settings, router_block_size)
    return VllmEngine(
        started.llm, started.info, started.usage, started.sampling, started.cache_events
    )


def start_vllm(settings: VllmEngineSettings, router_block_size: int) -> StartedVllm:
    """Start vLLM's ``AsyncLLM`` for ``settings`` (its engine core's processes: tens of
    seconds); its KV events (when ``settings`` publishes them) are named in the router's
    blocks of ``router_block_size`` tokens. VllmNotInstalledError without the
    ``pdd[vllm]`` extra."""
    try:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as exc:
        raise VllmNotInstalledError(
            f"--engine vllm needs vLLM, the pdd[vllm] extra: {INSTALL_HINT}"
        ) from exc
    kwargs = engine_kwargs(settings)
    if "kv_transfer_config" in kwargs:
        kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
    feed = None
    if settings.kv_events_endpoint is not None:  # subscribed before vLLM binds: none missed
        from pdd.worker.vllm.kv_events_feed import VllmKVEventFeed

        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
        feed = VllmKVEventFeed(
            settings.kv_events_endpoint, settings.kv_events_topic, router_block_size
        )
    usage = KVUsage()
    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(**kwargs, disable_log_stats=True), stat_loggers=[usage.logger_factory()]
    )

    def sampling(kwargs: dict[str, Any]) -> Any:
        return VllmSamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)

    return StartedVllm(llm, engine_info(llm.vllm_config, settings), usage, sampling, feed)


def engine_info(config: Any, settings: VllmEngineSettings) -> EngineInfo:
    """What vLLM got, as the pdd worker reports its engine (``GET /health``): blocks as its
    engine core sized them, limits as its scheduler holds them."""
    model, cache, scheduler = config.model_config, config.cache_config, config.scheduler_config
    blocks, block_size = int(cache.num_gpu_blocks), int(cache.block_size)
    layers = model.get_num_layers(config.parallel_config)
    kv_heads = model.get_num_kv_heads(config.parallel_config)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    kv_bytes = blocks * block_size * layers * 2 * kv_heads * model.get_head_size() * itemsize
    max_len = int(model.max_model_len)
    return EngineInfo(
        engine="vllm",
        device=str(config.device_config.device_type),
        dtype=str(model.dtype).removeprefix("torch."),
        dtype_reason="asked for" if settings.dtype != "auto" else "vLLM's auto",
        block_size=block_size,
        kv_blocks=blocks,
        kv_tokens=blocks * block_size,
        kv_bytes=kv_bytes,
        max_running_requests=int(scheduler.max_num_seqs),
        max_model_len=max_len,
        max_prompt_tokens=max_len - 1,
        max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
    )
