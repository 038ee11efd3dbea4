"""SIGTERM (what Kubernetes sends a pod it removes) drains a real relay process.

The relay ``rld_d`` is stopped for good; no other test uses it. MD's line is held to
a trickle until the relay has been told to stop and says so (``/ready`` answers 503),
so the relay is mid-request when it starts draining; then the line is restored. The
client's streams must be complete and equal to mono's, and the process must leave on
its own, with exit code 0, once nothing is live.
"""

from __future__ import annotations

import signal

import httpx
import pytest

from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration

TRICKLE_GBPS = 1e-5  # 10 kbit/s: the KV to MD stays in flight until the line is restored
MAX_TOKENS = 40


async def test_sigterm_drains_the_relay_and_loses_nothing(dp) -> None:
    prompts = dp.prompts(2, seed=53, lo=90, hi=91)
    expected = await dp.reference(prompts, MAX_TOKENS, "drain-p")
    relay, md_link = dp.cluster["rld_d"], dp.cluster["md"].link
    md_link.set_rate(TRICKLE_GBPS)
    signalled: list[int] = []

    def sigterm_the_relay_then_restore_md(event) -> None:
        if signalled or event.source != "rld_d":
            return
        relay.proc.send_signal(signal.SIGTERM)
        signalled.append(1)
        until_sync(
            lambda: httpx.get(f"{relay.url}/ready", timeout=5).status_code == 503,
            "the relay to say it is draining",
        )
        md_link.set_rate(1.0)

    plans = [
        dp.cluster.plan(f"drain-p-{i}", p, "P-RLD-MD", dp.sampling(i, MAX_TOKENS), relay="rld_d")
        for i, p in enumerate(prompts)
    ]
    try:
        results = await dp.run_all(plans, on_token=sigterm_the_relay_then_restore_md)
    finally:
        md_link.set_rate(1.0)
    assert signalled
    assert [r.token_ids for r in results] == expected
    assert all(r.duplicates == 0 and not r.errors for r in results)
    until_sync(lambda: relay.proc.poll() is not None, "the drained relay to exit")
    assert relay.proc.returncode == 0, relay.log_tail()
    assert "drained; nothing live" in relay.log.read_text()
    await dp.assert_quiescent()
