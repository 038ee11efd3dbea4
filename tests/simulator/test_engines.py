"""Decode and prefill instances against the step-time model they are built on."""

from __future__ import annotations

import pytest
import simpy

from pdd.common.vocabulary import Role
from pdd.simulator.decode import DecodeInstance
from pdd.simulator.hardware import InstanceShape
from pdd.simulator.prefill import PrefillInstance

pytestmark = pytest.mark.unit


def when(env: simpy.Environment, event: simpy.Event, out: dict, name: str) -> None:
    event.callbacks.append(lambda _: out.__setitem__(name, env.now))


def test_a_lone_sequence_decodes_at_the_step_time(shape: InstanceShape) -> None:
    env = simpy.Environment()
    md = DecodeInstance(env, "md0", Role.MAIN, shape, max_batch=8, cache=None)
    seq = md.submit(context=10_000, generate=100)
    out: dict = {}
    when(env, seq.done, out, "done")
    env.run()
    assert out["done"] == pytest.approx(100 * shape.decode_seconds(1, 10_000))
    assert md.stats.tokens == pytest.approx(100)


def test_a_batch_shares_steps_and_the_step_time_follows_the_batch(shape: InstanceShape) -> None:
    env = simpy.Environment()
    md = DecodeInstance(env, "md0", Role.MAIN, shape, max_batch=8, cache=None)
    short, long_ = md.submit(20_000, 10), md.submit(20_000, 30)
    out: dict = {}
    when(env, short.done, out, "short")
    when(env, long_.done, out, "long")
    env.run()
    two = shape.decode_seconds(2, 40_000)
    assert out["short"] == pytest.approx(10 * two)
    # After the short one leaves, the long one runs alone on its grown context.
    one = shape.decode_seconds(1, 20_000 + 10)
    assert out["long"] == pytest.approx(10 * two + 20 * one)


def test_admission_waits_for_kv_memory(shape: InstanceShape) -> None:
    env = simpy.Environment()
    md = DecodeInstance(env, "md0", Role.MAIN, shape, max_batch=8, cache=None)
    big = shape.kv_capacity_tokens * 2 // 3
    first, second = md.submit(big, 10), md.submit(big, 10)
    out: dict = {}
    when(env, first.done, out, "first")
    when(env, second.started, out, "second_started")
    env.run()
    assert out["second_started"] == pytest.approx(out["first"])
    assert md.active == 0


def test_max_batch_queues_and_counts_as_load(shape: InstanceShape) -> None:
    env = simpy.Environment()
    md = DecodeInstance(env, "md0", Role.MAIN, shape, max_batch=2, cache=None)
    seqs = [md.submit(1000, 5) for _ in range(3)]
    assert md.load().active == 3 and md.load().saturated
    assert not seqs[2].started.triggered
    env.run()
    assert all(s.done.triggered for s in seqs)


def test_stop_returns_the_tokens_produced_so_far(shape: InstanceShape) -> None:
    env = simpy.Environment()
    rld = DecodeInstance(env, "rld0", Role.RELAY, shape, max_batch=4, cache=None)
    seq = rld.submit(5000, 1000)
    step = shape.decode_seconds(1, 5000)
    env.run(until=40.5 * step)
    assert rld.stop(seq, hold=True) == 40
    assert rld.active == 1  # held until MD acknowledges
    rld.release()
    env.run()
    assert rld.active == 0 and not seq.done.triggered


def test_an_extend_pauses_the_batch_by_its_extra_cost(shape: InstanceShape) -> None:
    env = simpy.Environment()
    md = DecodeInstance(env, "md0", Role.MAIN, shape, max_batch=4, cache=None)
    seq = md.submit(30_000, 50)
    step = shape.decode_seconds(1, 30_000)
    out: dict = {}
    when(env, seq.done, out, "done")
    pause = md.extend(200, 30_000)
    extra = shape.step_seconds(201, 60_000, 30_000 + 200 * 30_000 + 200 * 200 / 2) - step
    env.run()
    assert pause.triggered and extra > 0
    assert out["done"] == pytest.approx(50 * step + extra)
    assert md.stats.stall_s == pytest.approx(extra)


def test_chunked_prefill_batches_the_tail_of_one_job_with_the_next(shape: InstanceShape) -> None:
    env = simpy.Environment()
    p = PrefillInstance(env, "p0", shape, max_num_batched_tokens=1000, max_queue=4, cache=None)
    out: dict = {}
    when(env, p.submit(1500, 0), out, "a")
    when(env, p.submit(500, 2000), out, "b")
    env.run(until=100)
    step1 = shape.step_seconds(1000, 1000, 1000 * 1000 / 2)
    # Step 2: a's last 500 tokens (after 1000 of its own) and all of b (after 2000 cached).
    step2 = shape.step_seconds(1000, 1500 + 2500, 500 * 1000 + 500**2 / 2 + 500 * 2000 + 500**2 / 2)
    assert out["a"] == pytest.approx(step1 + step2)
    assert out["b"] == pytest.approx(step1 + step2)
    assert p.stats.steps == 2 and p.active == 0


def test_a_full_hit_still_computes_one_token(shape: InstanceShape) -> None:
    env = simpy.Environment()
    p = PrefillInstance(env, "p0", shape, max_num_batched_tokens=1000, max_queue=4, cache=None)
    out: dict = {}
    when(env, p.submit(0, 5000), out, "a")
    env.run(until=10)
    assert out["a"] == pytest.approx(shape.prefill_seconds(1, 5000))
