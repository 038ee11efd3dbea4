from __future__ import annotations

import pytest

from pdd.local.topology import (
    NAIVE_ROUTER_FLAGS,
    Counts,
    StackConfig,
    TopologyError,
    router_argv,
    worker_specs,
)

pytestmark = pytest.mark.unit


def roles(mode: str, counts: Counts | None = None) -> list[tuple[str, str, bool]]:
    specs = worker_specs(mode, counts or Counts())  # type: ignore[arg-type]
    return [(s.name, s.role, s.wan_facing) for s in specs]


def test_each_mode_runs_its_workers_and_links() -> None:
    assert roles("pdd") == [("p0", "prefill", False), ("rld0", "relay", True),
                            ("md0", "main", True)]  # fmt: skip
    assert roles("naive") == [("p0", "prefill", False), ("md0", "main", True)]
    assert roles("samedc") == [("p0", "prefill", False), ("md0", "main", False)]
    assert roles("mono", Counts(mono=2)) == [("mono0", "mono", False), ("mono1", "mono", False)]
    assert len(roles("pdd", Counts(prefill=2, relay=3, main=2))) == 7


def test_counts_must_be_positive() -> None:
    with pytest.raises(TopologyError, match="--relay"):
        Counts(relay=0)


def test_router_is_told_its_workers_and_the_mode() -> None:
    workers = [("p0", "prefill", "http://h:1"), ("md0", "main", "http://h:2")]
    pdd = router_argv(StackConfig(mode="pdd", port=9000, ttft_budget_s=0.5), workers)
    assert pdd[:1] == ["router"] and "--prefill" in pdd and "p0=http://h:1" in pdd
    assert pdd[pdd.index("--port") + 1] == "9000"
    assert pdd[pdd.index("--link-gbps") + 1] == "0.05"
    assert pdd[pdd.index("--ttft-budget-s") + 1] == "0.5"
    assert not set(NAIVE_ROUTER_FLAGS) & set(pdd)
    for mode in ("naive", "samedc"):
        argv = router_argv(StackConfig(mode=mode), workers)  # type: ignore[arg-type]
        assert " ".join(NAIVE_ROUTER_FLAGS) in " ".join(argv)
    redis = router_argv(StackConfig(redis_url="redis://r:6379/0"), workers)
    assert redis[redis.index("--redis") + 1] == "redis://r:6379/0"
