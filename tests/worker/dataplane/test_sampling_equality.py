"""Penalties, logit bias, min_tokens and logprobs are the same on every pipeline.

Each role steers the logits from the request's own history (a main decode holds the
first token and the relay's tokens as handed-over IDs), and reports the logprobs of
the tokens it samples (P's first token travels with the KV). So the output of P-MD
and of P-RLD-MD in both handoff modes, after a handoff deep into the output, must be
mono's token for token, with the same logprobs. In-process, on a virtual clock.
"""

from __future__ import annotations

import pytest

from pdd.common.wire import TokenEvent

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

N = 4
MAX_TOKENS = 32
#: The WAN to MD opens once every relay has streamed this many tokens: MD's history then
#: holds many handed-over IDs, the case where a missing history would show.
RELAYED = 10


def assert_same_logprobs(got: list[TokenEvent], want: list[TokenEvent]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.logprobs is not None and w.logprobs is not None, (g, w)
        assert g.logprobs.logprob == pytest.approx(w.logprobs.logprob, abs=1e-4)
        assert [t.token_id for t in g.logprobs.top] == [t.token_id for t in w.logprobs.top]
        assert [t.logprob for t in g.logprobs.top] == pytest.approx(
            [t.logprob for t in w.logprobs.top], abs=1e-4
        )


async def test_steered_output_and_logprobs_equal_mono(vdp) -> None:
    prompts = vdp.prompts(N, seed=31, lo=30, hi=80)
    mono_plans = [
        vdp.cluster.plan(f"st-mono-{i}", p, "mono", vdp.steered(i, MAX_TOKENS), main="mono")
        for i, p in enumerate(prompts)
    ]
    reference = await vdp.run_all(mono_plans)
    plain = await vdp.reference(prompts, MAX_TOKENS, "st-plain")
    assert [r.token_ids for r in reference] != plain  # the options change the output
    for i, r in enumerate(reference):
        if vdp.steered(i, MAX_TOKENS).min_tokens:
            assert (
                7 not in r.token_ids[: MAX_TOKENS * 3 // 4]
            )  # the stop token waits for min_tokens
        if vdp.steered(i, MAX_TOKENS).logit_bias:
            assert 66 not in r.token_ids
    for pipeline, handoff in [("P-MD", "auto"), ("P-RLD-MD", "one-shot"), ("P-RLD-MD", "catch-up")]:
        results = await run(vdp, prompts, pipeline, handoff)
        assert [r.token_ids for r in results] == [r.token_ids for r in reference], pipeline
        for got, want in zip(results, reference, strict=True):
            assert got.duplicates == 0 and not got.errors
            assert_same_logprobs(got.tokens, want.tokens)
            assert got.sources[-1] == "md"
            if pipeline == "P-RLD-MD":
                assert got.sources[0] == "rld" and got.sources.index("md") > RELAYED
    await vdp.assert_quiescent()


async def run(vdp, prompts: list[list[int]], pipeline: str, handoff: str) -> list:
    """The prompts through ``pipeline``; for P-RLD-MD the WAN to MD stays shut until every
    relay is ``RELAYED`` tokens deep, so the handoff comes late."""
    plans = [
        vdp.cluster.plan(
            f"st-{pipeline}-{handoff}-{i}", p, pipeline, vdp.steered(i, MAX_TOKENS),
            handoff=handoff, catchup_threshold=2 if handoff == "catch-up" else 64,
        )
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    path = vdp.cluster.wan_path("md")
    streamed: dict[str, int] = {}

    def open_the_wan_once_relays_are_deep(event: TokenEvent) -> None:
        streamed[event.request_id] = event.seq
        if len(streamed) == len(plans) and min(streamed.values()) >= RELAYED:
            path.resume()

    if pipeline == "P-RLD-MD":
        path.pause()
    return await vdp.run_all(plans, on_token=open_the_wan_once_relays_are_deep)
