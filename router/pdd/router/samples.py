"""``n`` samples of one prompt, sharing the prompt's KV: the first is dispatched alone, the
others once it has passed prefill, so they are routed onto its prefix-cache hit.

Each sample is its own routed request (its own ``Generation``, seed ``seed + i`` where
a seed is given, so the samples differ and are reproducible). Dispatching them all at
once would prefill the prompt ``n`` times in parallel: no prefix cache holds it yet.
The text deltas of all samples come out as one stream of ``(index, delta)``; a failure
of any sample ends the whole request (the client asked for ``n`` choices).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

from pdd.router.generation import Generation, TextDelta
from pdd.router.openai_protocol import UsageInfo
from pdd.router.stoppable import StoppableTask
from pdd.router.stream_relay import STREAM_BUFFER_EVENTS

#: Starts sample ``i`` (routing it, taking its lease).
StartSample = Callable[[int], Awaitable[Generation]]


class _Done:
    """A sample's stream ended."""


class Samples:
    def __init__(self, first: Generation, n: int, start: StartSample) -> None:
        self.first = first
        self.n = n
        self._start = start
        self.generations: list[Generation] = [first]

    async def deltas(self) -> AsyncGenerator[tuple[int, TextDelta], None]:
        """Every sample's deltas, each tagged with its choice index, as they arrive."""
        if self.n == 1:
            async with contextlib.aclosing(self.first.deltas()) as deltas:
                async for delta in deltas:
                    yield 0, delta
            return
        # Bounded as each sample's own stream is: a client that reads slowly holds the
        # samples back instead of having the router buffer their whole answers.
        queue: asyncio.Queue[tuple[int, TextDelta | _Done | BaseException]]
        queue = asyncio.Queue(STREAM_BUFFER_EVENTS)
        # Stopped the anyio way: a pump may be inside an httpx call to a worker.
        tasks = [StoppableTask(self._pump(0, self.first, queue))]
        tasks.append(StoppableTask(self._start_rest(queue, tasks)))
        open_samples = self.n
        try:
            while open_samples:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Done):
                    open_samples -= 1
                    continue
                yield index, item
        finally:
            for task in tasks:
                task.stop()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task.task
            for generation in self.generations:
                generation.release()

    async def _start_rest(
        self,
        queue: asyncio.Queue[tuple[int, TextDelta | _Done | BaseException]],
        tasks: list[StoppableTask],
    ) -> None:
        await self.first.past_prefill.wait()
        for index in range(1, self.n):
            try:
                generation = await self._start(index)
            except Exception as exc:  # routing refused it: the request fails with the reason
                await queue.put((index, exc))
                return
            self.generations.append(generation)
            tasks.append(StoppableTask(self._pump(index, generation, queue)))

    @staticmethod
    async def _pump(
        index: int,
        generation: Generation,
        queue: asyncio.Queue[tuple[int, TextDelta | _Done | BaseException]],
    ) -> None:
        try:
            async for delta in generation.deltas():
                await queue.put((index, delta))
        except Exception as exc:
            await queue.put((index, exc))
            return
        await queue.put((index, _Done()))

    def usage(self) -> UsageInfo:
        """The prompt counted once (with the first sample's cache hit), every sample's
        output tokens summed."""
        completion = sum(g.completion_tokens for g in self.generations)
        return UsageInfo.of(self.first.prompt_tokens, completion, self.first.cached_tokens)
