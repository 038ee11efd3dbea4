"""The engine's drivers: the thread survives a failing step and fails exactly the requests it
held; the loop-stepped runner charges each step its time, so runs on a virtual clock are exact."""

import asyncio
import threading

import pytest

from pdd.common.wire import REQUEST_FAILED_ERROR_TYPE
from pdd.testing.waiting import until
from pdd.worker.engine import Engine
from pdd.worker.engine.request import FinishReason, RequestOutput
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.engine_runner import EngineRunner, LoopEngineRunner, ThreadEngineRunner

pytestmark = pytest.mark.unit


async def _collect(runner: EngineRunner, request_id: str, prompt: list[int]) -> RequestOutput:
    """Submit a request and wait for its final output."""
    done: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()

    def on_output(out: RequestOutput) -> None:
        if out.finished and not done.done():
            done.set_result(out)

    runner.subscribe(request_id, on_output)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    await runner.call(lambda e: e.add_request(prompt, params, request_id))
    return await asyncio.wait_for(done, timeout=60)


async def test_failed_step_ends_its_requests_with_an_error_and_keeps_serving(tiny, assert_no_leaks):
    engine = Engine(tiny, num_blocks=64)
    real_step, failures = engine.step, [RuntimeError("simulated kernel fault")]

    def flaky_step():
        if failures:
            raise failures.pop()
        return real_step()

    engine.step = flaky_step
    runner = ThreadEngineRunner(engine, asyncio.get_running_loop())
    runner.start()
    try:
        failed = await _collect(runner, "doomed", [1, 2, 3, 4, 5])
        assert failed.finish_reason is FinishReason.ABORT
        assert failed.error is not None and "simulated kernel fault" in failed.error
        ok = await _collect(runner, "after", [1, 2, 3, 4, 5])
        assert ok.error is None
    finally:
        runner.stop()
    assert_no_leaks(engine)


@pytest.mark.virtual_clock
async def test_loop_runner_charges_each_step_its_time_and_turns_when_idle(tiny, assert_no_leaks):
    engine = Engine(tiny, num_blocks=64)
    loop = asyncio.get_running_loop()
    runner = LoopEngineRunner(engine, loop, step_s=0.01)
    runner.start()
    try:
        await runner.next_step()  # an idle engine still turns, at no cost
        assert loop.time() == 0.0
        out = await _collect(runner, "r", [1, 2, 3, 4, 5])
        # one step prefills and samples the first token, seven more decode the rest
        assert len(out.new_token_ids) >= 1 and runner.snapshot.steps == 8
        assert loop.time() == pytest.approx(8 * 0.01)
        with pytest.raises(ValueError, match="step_s must be positive"):
            LoopEngineRunner(engine, loop, step_s=0)
    finally:
        runner.stop()
    assert_no_leaks(engine)


async def test_alive_is_whether_the_engine_is_being_driven(tiny):
    """The liveness probe's answer (/live): false before start and once the driver ended."""
    loop = asyncio.get_running_loop()
    for runner in (ThreadEngineRunner(Engine(tiny, num_blocks=16), loop),
                   LoopEngineRunner(Engine(tiny, num_blocks=16), loop, step_s=0.01)):  # fmt: skip
        assert not runner.alive
        runner.start()
        try:
            await runner.next_step()
            assert runner.alive
        finally:
            runner.stop()
        # a cancelled task is done once the loop has run it
        await until(lambda r=runner: not r.alive, "the stopped runner's task ended")
        assert not runner.alive


async def test_after_next_step_reads_what_a_step_wrote_before_the_next_starts(tiny):
    """A prefill in 32-token steps, each step held at a gate: ``fn`` registered before
    the first step runs after it and before the second, though the gate lets both go at
    once; a ``call`` made when the first step's outputs reach the loop would run after
    the second (the lag a streamed prefill's first chunk used to pay). On an idle
    engine it runs at once."""
    engine = Engine(tiny, num_blocks=64, max_num_batched_tokens=32)
    gate, real_step = threading.Semaphore(0), engine.step

    def gated_step():
        gate.acquire()
        return real_step()

    engine.step = gated_step
    runner = ThreadEngineRunner(engine, asyncio.get_running_loop())
    runner.start()
    try:
        idle = await asyncio.wait_for(runner.after_next_step(lambda e: e.has_unfinished()), 60)
        assert idle is False
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        await runner.call(lambda e: e.add_request(list(range(1, 101)), params, "r"))
        after_first = runner.after_next_step(lambda e: e.computed_tokens("r"))
        gate.release(2)  # steps 1 and 2 may both run now
        assert await asyncio.wait_for(after_first, 60) == 32
        gate.release(100)  # a step the engine started meanwhile must not hold the abort back
        await runner.call(lambda e: e.abort("r"))
    finally:
        gate.release(100)
        runner.stop()


@pytest.mark.parametrize("driver", ["thread", "loop"])
async def test_a_subscriber_that_raises_ends_its_own_request_alone(tiny, assert_no_leaks, driver):
    """The role's work on one request's output raises (a bug that request's output
    triggers): that request's subscriber is told once more, with an error, and the engine
    lets go of it; the request beside it streams every token to the end."""
    engine = Engine(tiny, num_blocks=64)
    loop = asyncio.get_running_loop()
    runner = ThreadEngineRunner(engine, loop) if driver == "thread" else LoopEngineRunner(
        engine, loop, step_s=0.001
    )  # fmt: skip
    seen: list[RequestOutput] = []
    ended: asyncio.Future[RequestOutput] = loop.create_future()

    def fragile(out: RequestOutput) -> None:
        seen.append(out)
        if out.error is not None:
            ended.set_result(out)
        elif len(seen) == 3:
            raise ValueError("a bug on this request's third output")

    runner.subscribe("fragile", fragile)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runner.start()
    try:
        await runner.call(lambda e: e.add_request([7, 8, 9], params, "fragile"))
        other = await _collect(runner, "other", [1, 2, 3, 4, 5])
        failed = await asyncio.wait_for(ended, timeout=60)
        assert other.error is None and other.finish_reason is FinishReason.LENGTH
        assert failed.finish_reason is FinishReason.ABORT and "third output" in (failed.error or "")
        assert failed.error_type == REQUEST_FAILED_ERROR_TYPE
        stats = lambda: runner.snapshot.stats  # noqa: E731
        await until(lambda: stats().num_running + stats().num_waiting == 0, "the engine let go")
        assert [o for o in seen if o.error is not None] == [failed]
    finally:
        runner.stop()
    assert_no_leaks(engine)
