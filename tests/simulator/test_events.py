"""The event helpers: an alarm rings once at the last time asked for, with few events."""

from __future__ import annotations

import pytest
import simpy

from pdd.simulator.events import Alarm, run_until, succeed_after

pytestmark = pytest.mark.unit


def _alarm() -> tuple[simpy.Environment, Alarm, list[float]]:
    env = simpy.Environment()
    rang: list[float] = []
    return env, Alarm(env, lambda: rang.append(env.now)), rang


def _at(env: simpy.Environment, t: float, action) -> None:
    env.timeout(t).callbacks.append(lambda _: action())


def _steps(env: simpy.Environment) -> int:
    """Run to the end; how many events the loop popped."""
    steps = 0
    while env.peek() != float("inf"):
        env.step()
        steps += 1
    return steps


def test_moving_the_due_time_later_rings_once_at_the_last_time() -> None:
    env, alarm, rang = _alarm()
    alarm.set(1.0)
    _at(env, 0.5, lambda: alarm.set(2.0))  # later: keeps the queued timer, re-arms at 1.0
    _at(env, 0.7, lambda: alarm.set(2.5))
    assert _steps(env) == 4  # the test's 2 timers, the alarm's first timer and one re-arm
    assert rang == [3.2]


def test_moving_it_earlier_rings_at_the_earlier_time_only() -> None:
    env, alarm, rang = _alarm()
    alarm.set(5.0)
    _at(env, 1.0, lambda: alarm.set(1.0))
    env.run()
    assert rang == [2.0]


def test_a_cleared_alarm_stays_silent_and_can_be_set_again() -> None:
    env, alarm, rang = _alarm()
    alarm.set(1.0)
    _at(env, 0.5, alarm.clear)
    _at(env, 3.0, lambda: alarm.set(0.0))
    env.run()
    assert rang == [3.0]


def test_succeed_after_fires_once_after_the_delay() -> None:
    env = simpy.Environment()
    done = env.event()
    succeed_after(env, done, 0.25)
    seen: list[float] = []
    done.callbacks.append(lambda _: seen.append(env.now))
    with pytest.raises(RuntimeError):
        succeed_after(env, done, 1.0)
    env.run()
    assert seen == [0.25]


def _trace(run) -> tuple[list[tuple[float, str]], float]:
    """What a small model does under ``run``: processes and timers, some due exactly at
    the stop time, some urgent (a process's start) at it."""
    env = simpy.Environment()
    seen: list[tuple[float, str]] = []

    def worker(name: str, gaps: list[float]):
        for gap in gaps:
            yield env.timeout(gap)
            seen.append((env.now, name))
            if env.now == 2.0 and "child" not in name:
                env.process(worker(f"{name}-child", [0.0, 1.0]))

    env.process(worker("a", [0.5, 1.5, 1.0]))
    env.process(worker("b", [2.0, 0.0, 0.25]))
    env.timeout(3.0).callbacks.append(lambda _: seen.append((env.now, "timer at the stop")))
    run(env, 3.0)
    return seen, env.now


def test_run_until_pops_the_same_events_in_the_same_order_as_simpy_run() -> None:
    assert _trace(run_until) == _trace(lambda env, until: env.run(until=until))
    with pytest.raises(ValueError):
        run_until(simpy.Environment(), 0.0)
