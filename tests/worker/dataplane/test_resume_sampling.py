"""A request resumed by the router after a failure mid-stream is the unbroken one, token
for token, under penalties, ``min_tokens`` and a seed.

The router is the real one (``RouterRuntime``, ``OpenAIServing``, ``Generation``'s
recovery) over in-process workers on a virtual clock. The main decode ``md_v`` is killed
once the client holds ``BROKEN_AT`` tokens; the router resumes the request on P and the
relay with the prompt plus those tokens, and their count in
``SamplingSpec.prior_output_tokens``, so the new instances count them as output. Greedy
with frequency/presence penalties is the case that forks when they are counted as prompt.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from pdd.common.vocabulary import Pipeline, Role
from pdd.local.probes import flatten
from pdd.router.generation import Generation
from pdd.router.openai_protocol import CompletionRequest
from pdd.router.runtime import RouterRuntime
from pdd.router.serving_base import OpenAIServing

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

MAX_TOKENS = 32
BROKEN_AT = 12
STEERED: dict[str, Any] = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "min_tokens": 24,
                           "stop_token_ids": [7], "logit_bias": {"7": 6.0}}  # fmt: skip
GREEDY: dict[str, Any] = {"temperature": 0.0}
SEEDED: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "seed": 11,
                          "repetition_penalty": 1.2}  # fmt: skip


def router(vdp) -> AbstractAsyncContextManager[RouterRuntime]:
    """A router over P, RLD and the victim MD; it polls once at start."""
    workers = ((Role.PREFILL, "p"), (Role.RELAY, "rld"), (Role.MAIN, "md_v"))
    return vdp.cluster.router(workers)


async def complete(
    vdp, runtime: RouterRuntime, prompt: list[int], fields: dict[str, Any], crash_at: int | None
) -> Generation:
    """One completion through the router's serving layer, read to the end; with
    ``crash_at``, MD dies once the client holds that many tokens."""
    request = CompletionRequest(
        model=runtime.config.served_name, prompt=prompt, max_tokens=MAX_TOKENS, **fields
    )
    generation = await OpenAIServing(runtime).start(prompt, request, MAX_TOKENS, "prompt")
    victim = vdp.cluster["md_v"]
    async for _ in generation.deltas():
        if crash_at is not None and len(generation.token_ids) >= crash_at and victim.alive:
            vdp.cluster.crash("md_v")
    return generation


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_resumed_request_equals_the_unbroken_one(vdp, sampling) -> None:
    prompt = vdp.prompts(1, seed=72, lo=90, hi=91)[0]
    fields = {**STEERED, **sampling}
    async with router(vdp) as rt:
        plain = await complete(vdp, rt, prompt, sampling, None)
        unbroken = await complete(vdp, rt, prompt, fields, None)
        assert unbroken.route.pipeline == Pipeline.P_MD
        assert unbroken.token_ids != plain.token_ids  # the options change the output
        assert 7 not in unbroken.token_ids[: STEERED["min_tokens"]]

        broken = await complete(vdp, rt, prompt, fields, BROKEN_AT)
        resumes = flatten(rt.metrics.render().decode())
        assert resumes.get('pdd_router_recoveries_total{kind="resume"}') == 1
        assert broken.route.pipeline == Pipeline.P_RLD  # MD is gone: the relay finished it
        assert broken.token_ids == unbroken.token_ids
    await vdp.assert_quiescent()
