"""The WAN line shares its bandwidth fairly among flows; the in-DC path does not contend."""

from __future__ import annotations

import pytest
import simpy

from pdd.simulator.links import DirectLink, SharedLink

pytestmark = pytest.mark.unit

GBPS = 8.0  # 1e9 bytes/s: a byte count in GB is its solo serialization time in s


def finish_times(env: simpy.Environment, events: dict[str, simpy.Event]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, ev in events.items():
        ev.callbacks.append(lambda _, name=name: out.__setitem__(name, env.now))
    env.run()
    return out


def test_one_flow_takes_serialization_plus_rtt() -> None:
    env = simpy.Environment()
    link = SharedLink(env, GBPS, rtt_ms=30, jitter_ms=0, seed=0)
    done = finish_times(env, {"a": link.transfer(2e9)})
    assert done["a"] == pytest.approx(2.0 + 0.030)
    assert link.busy_s == pytest.approx(2.0)


def test_concurrent_flows_share_the_line_fairly() -> None:
    env = simpy.Environment()
    link = SharedLink(env, GBPS, rtt_ms=0, jitter_ms=0, seed=0)
    done = finish_times(env, {"big": link.transfer(3e9), "small": link.transfer(1e9)})
    # Both get half the line until the small one ends at 2 s; the big one then has 2 GB
    # sent and 1 GB left at full rate: 4 s in all, the same total as back to back.
    assert done["small"] == pytest.approx(2.0)
    assert done["big"] == pytest.approx(4.0)


def test_a_late_small_flow_is_not_stuck_behind_a_big_one() -> None:
    """Processor sharing, not FIFO: a small delta arriving during a 10 GB transfer lands in
    about twice its solo time, long before the big transfer ends."""
    env = simpy.Environment()
    link = SharedLink(env, GBPS, rtt_ms=0, jitter_ms=0, seed=0)
    big = link.transfer(10e9)
    late: dict[str, float] = {}

    def later():
        yield env.timeout(1.0)
        ev = link.transfer(0.5e9)
        yield ev
        late["small"] = env.now

    env.process(later())
    done = finish_times(env, {"big": big})
    assert late["small"] == pytest.approx(2.0)
    assert done["big"] == pytest.approx(10.5)


def test_jitter_only_adds_delay_and_is_seeded() -> None:
    def run(seed: int) -> float:
        env = simpy.Environment()
        link = SharedLink(env, GBPS, rtt_ms=20, jitter_ms=5, seed=seed)
        return finish_times(env, {"a": link.transfer(1e6)})["a"]

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert run(1) >= 0.001 + 0.020


def test_in_datacenter_transfers_do_not_contend() -> None:
    env = simpy.Environment()
    link = DirectLink(env, gbps=GBPS, latency_ms=1)
    done = finish_times(env, {"a": link.transfer(1e9), "b": link.transfer(1e9)})
    assert done == {"a": pytest.approx(1.001), "b": pytest.approx(1.001)}
