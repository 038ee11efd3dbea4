"""Tools and ``n`` through the real router and the official ``openai`` SDK, in process.

The router is the real one (``create_app`` over ``RouterRuntime``: template, tokenizer,
routing, relay, detokenizer, the tool-call parser, SSE), with a Qwen2 checkpoint that
transformers wrote (random weights, the Qwen2.5 template with tools, tool call format
detected from it), in front of in-process P, RLD and MD workers serving that checkpoint
on a virtual clock. The SDK reaches the router's ASGI app in process.

Random weights never write a tool call, so the tool-call tests script what "the model
wrote": the workers really prefill and decode (the route, the KV, the prefix cache and
``cached_tokens`` are theirs), and only the token IDs of the stream the router reads are
replaced, position by position, by the tokens of a known tool-call text, the last one
finishing as a model's EOS would (``finish_reason`` stop). Everything from the token IDs
to the SDK's parsed ``tool_calls`` is the production path.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from pdd.common.block_hash import block_hashes
from pdd.common.vocabulary import Role
from pdd.local.cluster import LinkSpec, WorkerSpec
from pdd.router import generation
from pdd.router.openai_protocol import CompletionRequest
from pdd.router.runtime import RouterRuntime
from pdd.router.serving_base import OpenAIServing
from pdd.router.stream_relay import relay_tokens
from pdd.worker.model.loader import load_model

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

QWEN_TEMPLATE = Path(__file__).parents[2] / "router" / "chat_templates" / "qwen.jinja"
ROUTER = "router:8080"
BLOCK = 16
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 checkpoint with the Qwen2.5 chat template (tools included)."""
    spec = importlib.util.spec_from_file_location(
        "pdd_test_checkpoints_tools", Path(__file__).parents[1] / "checkpoints.py"
    )
    checkpoints = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checkpoints)
    out = checkpoints.write_hf_checkpoint(
        tmp_path_factory.mktemp("qwen-tools"), "qwen2", max_position_embeddings=2048
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "chat_template": QWEN_TEMPLATE.read_text(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture
async def stack(qwen_dir: Path) -> AsyncIterator[tuple[RouterRuntime, openai.AsyncOpenAI]]:
    """The router over P, RLD and MD serving the checkpoint, and an SDK client for it."""
    inprocess = sys.modules["pdd_test_inprocess"]  # loaded by path in this folder's conftest
    model = load_model(str(qwen_dir))
    specs = [
        WorkerSpec("p", "prefill"),
        WorkerSpec("rld", "relay", wan_facing=True),
        WorkerSpec("md", "main", wan_facing=True),
    ]
    link = LinkSpec(gbps=1.0, rtt_ms=4.0)
    async with inprocess.InProcessCluster(
        model, specs, link, block_size=BLOCK, num_blocks=256
    ) as cluster:
        workers = ((Role.PREFILL, "p"), (Role.RELAY, "rld"), (Role.MAIN, "md"))
        async with (
            cluster.router(workers, model=str(qwen_dir)) as runtime,
            cluster.openai_client(runtime, ROUTER) as client,
        ):
            yield runtime, client


def script_output(monkeypatch: pytest.MonkeyPatch, token_ids: list[int]) -> None:
    """The workers' streams, with the token at each position replaced by the script's."""

    async def scripted(plan, *args, **kwargs):
        async for event in relay_tokens(plan, *args, **kwargs):
            last = event.seq == len(token_ids) - 1
            update = {"token_id": token_ids[event.seq]}
            if last:
                update |= {"finished": True, "finish_reason": "stop"}
            yield event.model_copy(update=update)

    monkeypatch.setattr(generation, "relay_tokens", scripted)


def full_block_prefix(a: list[int], b: list[int]) -> int:
    """Tokens of ``b`` a cache holding ``a``'s full blocks can serve."""
    shared = 0
    for x, y in zip(block_hashes(a, BLOCK), block_hashes(b, BLOCK), strict=False):
        if x != y:
            break
        shared += BLOCK
    return shared


def script_ids(runtime: RouterRuntime, text: str) -> list[int]:
    ids = runtime.tokenizer.tokenizer.encode(text, add_special_tokens=False)
    assert runtime.tokenizer.tokenizer.decode(ids) == text
    return ids


async def test_the_sdk_parses_tool_calls_and_the_tool_result_turn_keeps_the_cache_hit(
    stack, monkeypatch
) -> None:
    runtime, client = stack
    assert runtime.tool_call_format == "hermes"  # detected from the template
    script = script_ids(runtime, CALL_TEXT)
    script_output(monkeypatch, script)
    common = {
        "model": runtime.config.served_name, "tools": TOOLS, "max_tokens": len(script),
        "temperature": 0.0, "extra_body": {"ignore_eos": True},
    }  # fmt: skip

    first = await client.chat.completions.create(messages=[USER], **common)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert first.usage.completion_tokens == len(script)

    async with client.chat.completions.stream(messages=[USER], **common) as stream:
        async for _ in stream:
            pass
        streamed = await stream.get_final_completion()
    s_choice = streamed.choices[0]
    assert s_choice.finish_reason == "tool_calls"
    assert s_choice.message.content.strip() == "Let me check."
    [s_call] = s_choice.message.tool_calls
    assert s_call.function.name == "get_weather" and s_call.id.startswith("call_")
    assert json.loads(s_call.function.arguments) == {"city": "Paris"}

    # The next turn carries the call and its result: the first turn's prompt is its prefix.
    assistant = choice.message.model_dump(exclude_none=True)
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}
    turn2 = [USER, assistant, result]
    second = await client.chat.completions.create(messages=turn2, **common)
    prompt1 = runtime.tokenizer.chat_ids([USER], True, TOOLS)
    prompt2 = runtime.tokenizer.chat_ids(
        [USER, {**assistant, "tool_calls": [_decoded(assistant["tool_calls"][0])]}, result],
        True,
        TOOLS,
    )
    assert second.usage.prompt_tokens == len(prompt2)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in runtime.tokenizer.tokenizer.decode(
        prompt2
    )
    hit = full_block_prefix(prompt1, prompt2)
    assert hit >= len(prompt1) - 2 * BLOCK  # the whole first prompt but its tail block(s)
    assert second.usage.prompt_tokens_details.cached_tokens == hit


def _decoded(call: dict) -> dict:
    function = call["function"]
    return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}


async def test_tool_choice_none_renders_the_tools_but_reads_no_calls(stack, monkeypatch) -> None:
    runtime, client = stack
    script = script_ids(runtime, CALL_TEXT)
    script_output(monkeypatch, script)
    response = await client.chat.completions.create(
        model=runtime.config.served_name, messages=[USER], tools=TOOLS, tool_choice="none",
        max_tokens=len(script), extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content == CALL_TEXT
    assert response.choices[0].finish_reason == "stop"
    with_tools = runtime.tokenizer.chat_ids([USER], True, TOOLS)
    assert response.usage.prompt_tokens == len(with_tools)


async def test_n_samples_are_indexed_and_summed(stack) -> None:
    runtime, client = stack
    common = {
        "model": runtime.config.served_name, "messages": [USER], "n": 3, "seed": 5,
        "max_tokens": 6, "temperature": 1.0, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    response = await client.chat.completions.create(**common)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == 18
    assert response.usage.prompt_tokens == len(runtime.tokenizer.chat_ids([USER]))
    again = await client.chat.completions.create(**common)
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in response.choices
    ]  # seed + i: reproducible
    stream = await client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True}
    )
    texts = ["", "", ""]
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 18
    assert texts == [c.message.content for c in response.choices]


async def test_later_samples_hit_the_prompt_the_first_prefilled(stack) -> None:
    runtime, _ = stack
    prompt = script_ids(runtime, "The quick brown fox jumps over the lazy dog. " * 3)
    request = CompletionRequest(
        model=runtime.config.served_name, prompt=prompt, n=3, seed=1, max_tokens=4,
        ignore_eos=True,
    )  # fmt: skip
    serving = OpenAIServing(runtime)
    samples = await serving.start_samples(prompt, request, 4, "prompt")
    outputs = [[], [], []]
    async for index, delta in samples.deltas():
        outputs[index].append(delta.text)
    assert len(samples.generations) == 3
    full = len(prompt) // BLOCK * BLOCK
    hits = [g.cached_tokens for g in samples.generations]
    assert hits == [0, full, full]  # dispatched after the first's prefill: its blocks hit
    assert samples.usage().prompt_tokens_details.cached_tokens == 0
    assert samples.usage().completion_tokens == 12
    assert not any((await runtime.store.inflight()).values())  # every sample's lease back

    # A client that goes away after the first delta: every sample started is given back.
    gone = await serving.start_samples(prompt, request, 4, "prompt")
    deltas = gone.deltas()
    await anext(deltas)
    await deltas.aclose()
    assert not any((await runtime.store.inflight()).values())


async def test_parallel_tool_calls_false_keeps_the_first_call(stack, monkeypatch) -> None:
    runtime, client = stack
    second_call = (
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    script = script_ids(runtime, CALL_TEXT + second_call)
    script_output(monkeypatch, script)
    common = {
        "model": runtime.config.served_name, "messages": [USER], "tools": TOOLS,
        "max_tokens": len(script), "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    both = await client.chat.completions.create(**common)
    cities = [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls]
    assert cities == ["Paris", "Rome"]
    for stream in (False, True):
        if stream:
            async with client.chat.completions.stream(**common, parallel_tool_calls=False) as s:
                async for _ in s:
                    pass
                message = (await s.get_final_completion()).choices[0].message
        else:
            one = await client.chat.completions.create(**common, parallel_tool_calls=False)
            message = one.choices[0].message
        [call] = message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris"}


async def test_n_completions_stream_each_choice_with_its_index(stack) -> None:
    runtime, client = stack
    common = {
        "model": runtime.config.served_name, "prompt": "The quick brown fox", "n": 2,
        "seed": 3, "max_tokens": 5, "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    whole = await client.completions.create(**common, echo=True)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.text.startswith("The quick brown fox") for c in whole.choices)
    texts = ["", ""]
    async for chunk in await client.completions.create(**common, echo=True, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]
