"""MD streams P's first token the moment it has it, and every stream still ends right.

MD gets the first token (sampled by P) with the KV, and streams it before its engine
runs the resume step, so the client does not wait for that step (nor for the step the
engine was in). Whether that token ends the request (``max_tokens`` 1, a stop id, EOS,
a grammar it completes) only MD's engine decides, in that step: the stream then ends
with a finish event after the token, and the client gets the token once and the finish
once. In-process on a virtual clock: the gap the early send opens before the second
token is loop time, the same on every machine. The last tests go through the router's
serving layer (stop strings, ``n``, logprobs, usage) on P-MD.
"""

from __future__ import annotations

import asyncio
import json
import sys
from contextlib import AbstractAsyncContextManager

import pytest

from pdd.common.vocabulary import Role
from pdd.common.wire import GuidedDecoding, SamplingSpec
from pdd.router.openai_protocol import CompletionRequest
from pdd.router.runtime import RouterRuntime
from pdd.router.serving_completions import OpenAIServingCompletion

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

#: The pipelines where MD streams the first token itself (P-RLD-MD: the relay does).
MD_FIRST = ("P-MD", "naive")
EOS = 257  # the tiny model's byte tokenizer
#: A schema whose only value is one token long: the first token completes the grammar.
ONE_TOKEN_SCHEMA = GuidedDecoding(kind="json_schema", schema_text=json.dumps({"enum": [7]}))


async def run_timed(vdp, plan):
    """Run ``plan``; the run and the loop time at which each event reached the client."""
    loop = asyncio.get_running_loop()
    stamps: list[float] = []
    [run] = await vdp.run_all([plan], on_token=lambda _event: stamps.append(loop.time()))
    return run, stamps


def assert_one_finish(run, tokens: list[int], reason: str) -> None:
    """The client got ``tokens``, each once, then one finish with ``reason``."""
    assert run.token_ids == tokens
    assert run.finishes == [reason]
    assert run.events[-1].finished
    assert run.duplicates == 0 and not run.errors


async def test_the_first_token_leaves_md_a_step_before_the_second(vdp) -> None:
    """Before, the first token went out with the resume step's output, together with the
    second; now it goes out before that step, at least one step earlier."""
    step_s = sys.modules["pdd_test_inprocess"].STEP_S  # loaded by path in the conftest
    prompt = vdp.prompts(1, seed=41)[0]
    [expected] = await vdp.reference([prompt], 4, "ft-early-ref")
    for pipeline in MD_FIRST:
        plan = vdp.cluster.plan(f"ft-early-{pipeline}", prompt, pipeline, vdp.sampling(0, 4))
        run, stamps = await run_timed(vdp, plan)
        assert_one_finish(run, expected, "length")
        assert run.sources == ["md"] * 4
        assert stamps[1] - stamps[0] >= step_s - 1e-9, pipeline  # loop time is a float
    await vdp.assert_quiescent()


@pytest.mark.parametrize("pipeline", [*MD_FIRST, "P-RLD-MD", "P-RLD"])
async def test_max_tokens_one_finishes_once_with_length(vdp, pipeline: str) -> None:
    prompts = vdp.prompts(4, seed=42)
    expected = await vdp.reference(prompts, 1, f"ft-one-ref-{pipeline}")
    plans = [
        vdp.cluster.plan(f"ft-one-{pipeline}-{i}", p, pipeline, vdp.sampling(i, 1))
        for i, p in enumerate(prompts)
    ]
    for run, tokens in zip(await vdp.run_all(plans), expected, strict=True):
        assert_one_finish(run, tokens, "length")
        if pipeline in MD_FIRST:  # the token went out before MD's engine ended the request
            assert [e.is_token for e in run.events] == [True, False]
    await vdp.assert_quiescent()


@pytest.mark.parametrize("pipeline", [*MD_FIRST, "P-RLD-MD"])
async def test_a_first_token_that_is_a_stop_id_or_eos_finishes_once_with_stop(
    vdp, pipeline: str
) -> None:
    prompt = vdp.prompts(1, seed=43)[0]
    [first, *_] = (await vdp.reference([prompt], 4, f"ft-stop-ref-{pipeline}"))[0]
    stop_id = SamplingSpec(max_tokens=8, stop_token_ids=(first,))
    eos_first = SamplingSpec(max_tokens=8, logit_bias=((EOS, 100.0),))  # EOS is sampled first
    for name, sampling, tokens in (("id", stop_id, [first]), ("eos", eos_first, [EOS])):
        plan = vdp.cluster.plan(f"ft-stop-{pipeline}-{name}", prompt, pipeline, sampling)
        [run] = await vdp.run_all([plan])
        assert_one_finish(run, tokens, "stop")
    await vdp.assert_quiescent()


@pytest.mark.parametrize("pipeline", [*MD_FIRST, "P-RLD-MD"])
async def test_the_first_token_carries_p_s_logprobs_and_the_finish_follows(
    vdp, pipeline: str
) -> None:
    prompt = vdp.prompts(1, seed=44)[0]
    sampling = SamplingSpec(max_tokens=1, ignore_eos=True, logprobs=3)
    [want] = await vdp.run_all(
        [vdp.cluster.plan(f"ft-lp-ref-{pipeline}", prompt, "mono", sampling, main="mono")]
    )
    [run] = await vdp.run_all([vdp.cluster.plan(f"ft-lp-{pipeline}", prompt, pipeline, sampling)])
    assert_one_finish(run, want.token_ids, "length")
    [got_token], [want_token] = run.tokens, want.tokens
    assert got_token.logprobs is not None and want_token.logprobs is not None
    assert got_token.logprobs.logprob == pytest.approx(want_token.logprobs.logprob, abs=1e-4)
    assert [t.token_id for t in got_token.logprobs.top] == [
        t.token_id for t in want_token.logprobs.top
    ]
    assert got_token.cached_tokens is not None  # P's hit rides on the first token, as before
    await vdp.assert_quiescent()


@pytest.mark.parametrize("pipeline", [*MD_FIRST, "P-RLD-MD"])
async def test_a_first_token_that_completes_the_grammar_finishes_once_with_stop(
    vdp, pipeline: str
) -> None:
    sampling = SamplingSpec(max_tokens=8, temperature=1.0, seed=5, guided=ONE_TOKEN_SCHEMA)
    prompt = vdp.prompts(1, seed=45)[0]
    [run] = await vdp.run_all([vdp.cluster.plan(f"ft-gr-{pipeline}", prompt, pipeline, sampling)])
    assert_one_finish(run, list(b"7"), "stop")
    await vdp.assert_quiescent()


# --- through the router's serving layer: text, stop strings, n, usage ---------------------


def p_md_router(vdp) -> AbstractAsyncContextManager[RouterRuntime]:
    """A router over P and MD only (no relay): every request it routes is P-MD."""
    return vdp.cluster.router(((Role.PREFILL, "p"), (Role.MAIN, "md")))


def x_first(runtime: RouterRuntime, prompt: list[int], **fields) -> CompletionRequest:
    """A completion whose every token is ``x`` (logit bias), on every role."""
    return CompletionRequest(
        model=runtime.config.served_name, prompt=prompt, temperature=0.0, ignore_eos=True,
        logit_bias={str(ord("x")): 100.0}, **fields,
    )  # fmt: skip


async def sse_choices(served) -> dict[int, tuple[str, list[str]]]:
    """A streamed completion's text and finish reasons, per choice index."""
    out: dict[int, tuple[str, list[str]]] = {}
    async for frame in served.body:
        for line in frame.decode().splitlines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                text, finishes = out.get(choice["index"], ("", []))
                reason = choice["finish_reason"]
                out[choice["index"]] = (text + choice["text"], finishes + ([reason] * bool(reason)))
    return out


async def test_n_one_token_samples_through_the_router_each_finish_once(vdp) -> None:
    prompt = vdp.prompts(1, seed=46)[0]
    async with p_md_router(vdp) as runtime:
        serving = OpenAIServingCompletion(runtime)
        request = x_first(runtime, prompt, max_tokens=1, n=2, logprobs=2)
        served = await serving.create(request)
        assert served.headers["x-pdd-pipeline"] == "P-MD"
        response = served.body
        assert [(c.text, c.finish_reason) for c in response.choices] == [("x", "length")] * 2
        assert all(len(c.logprobs.tokens) == 1 for c in response.choices)
        assert response.usage.completion_tokens == 2
        streamed = await serving.create(request.model_copy(update={"stream": True}))
        assert await sse_choices(streamed) == {0: ("x", ["length"]), 1: ("x", ["length"])}
        await vdp.assert_quiescent()


async def test_stop_strings_through_the_router_with_an_early_first_token(vdp) -> None:
    prompt = vdp.prompts(1, seed=47)[0]
    async with p_md_router(vdp) as runtime:
        serving = OpenAIServingCompletion(runtime)
        cases = [  # (max_tokens, stop, text, finish)
            (4, ["x"], "", "stop"),  # the first token is the stop string
            (1, ["q"], "x", "length"),  # a stop string that never comes
            (3, ["q"], "xxx", "length"),
        ]
        for max_tokens, stop, text, finish in cases:
            request = x_first(runtime, prompt, max_tokens=max_tokens, stop=stop)
            [choice] = (await serving.create(request)).body.choices
            assert (choice.text, choice.finish_reason) == (text, finish), stop
            streamed = await serving.create(request.model_copy(update={"stream": True}))
            assert await sse_choices(streamed) == {0: (text, [finish])}, stop
        await vdp.assert_quiescent()  # a stopped request is cancelled by the router
