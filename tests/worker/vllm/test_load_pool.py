"""The vLLM connector's load threads (pdd.worker.vllm.load_pool), with stand-in loads: no
vLLM needed. Each test ends the pool with ``shutdown``, which waits for its threads, so
what a load did is settled before the test reads it (no sleeps, no polling). What
``collect`` reports of ended loads is tested with vLLM (``test_connector_async``).
"""

from __future__ import annotations

import threading

import pytest

from pdd.worker.vllm.load_pool import LoadPool

pytestmark = pytest.mark.unit


def test_a_load_runs_on_a_pool_thread_and_submit_does_not_wait() -> None:
    pool = LoadPool(2)
    release, ran_on = threading.Event(), []

    def load(cancelled: threading.Event) -> set[int]:
        ran_on.append(threading.current_thread().name)
        release.wait()
        return {7, 8}

    pool.submit("r", load)
    assert pool.collect().request_ids == set()  # still held: submit did not wait for it
    release.set()
    pool.shutdown()
    assert ran_on and ran_on[0].startswith("pdd-kv-load")


def test_a_cancelled_load_sees_its_event() -> None:
    pool = LoadPool(1)
    seen = []

    def load(cancelled: threading.Event) -> set[int]:
        seen.append(cancelled.wait())  # returns only once cancelled
        return set()

    pool.submit("aborted", load)
    pool.cancel({"other", "aborted"})  # requests without a load are ignored
    pool.shutdown()
    assert seen == [True]


def test_one_load_per_request_at_a_time() -> None:
    pool = LoadPool(1)
    release = threading.Event()
    pool.submit("r", lambda cancelled: release.wait() and set())
    with pytest.raises(RuntimeError, match="already has a KV load"):
        pool.submit("r", lambda cancelled: set())
    release.set()
    pool.shutdown()


def test_no_threads_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one load thread"):
        LoadPool(0)
