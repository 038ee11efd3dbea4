"""Forced tool calls through Qwen3- and Llama-3.1-style chat templates, with the openai SDK.

Each checkpoint is written by transformers (random weights: a Qwen3 model with a Qwen3
template, a Llama model with a Llama-3.1 template whose tool calls are bare JSON
objects), served by in-process P, RLD and MD workers behind the real router on a virtual
clock. The router detects each template's ``tool_call_format``; ``tool_choice``
``"required"`` or a named function has the grammar force a call in that format, which the
router's parser (whole and streaming) turns into ``tool_calls`` the SDK accumulates. The
templates are in ``tests/router/chat_templates`` (checked against transformers there).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from pdd.common.vocabulary import Role, ToolCallFormat
from pdd.local.cluster import LinkSpec, WorkerSpec
from pdd.router.runtime import RouterRuntime
from pdd.worker.model.loader import load_model

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]

TEMPLATES = Path(__file__).parents[2] / "router" / "chat_templates"
ROUTER = "router:8080"
BLOCK = 16
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"tz": {"enum": ["CET", "UTC"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
]
USER = {"role": "user", "content": "What is the weather in Paris?"}
#: template file, architecture, tokenizer_config extras, the format the router must detect
MODELS = {
    "qwen3": ("qwen3.jinja", "qwen3", {}, ToolCallFormat.HERMES),
    "llama31": ("llama31.jinja", "llama", {"bos_token": "<s>"}, ToolCallFormat.LLAMA3_JSON),
}


def write_checkpoint(root: Path, name: str) -> Path:
    template, arch, extra, _ = MODELS[name]
    spec = importlib.util.spec_from_file_location(
        "pdd_test_checkpoints_templates", Path(__file__).parents[1] / "checkpoints.py"
    )
    checkpoints = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checkpoints)
    out = checkpoints.write_hf_checkpoint(root, arch, max_position_embeddings=2048)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "chat_template": (TEMPLATES / template).read_text(),
        **extra,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(params=sorted(MODELS))
async def stack(request, tmp_path) -> AsyncIterator[tuple[str, RouterRuntime, openai.AsyncOpenAI]]:
    """The router over P, RLD and MD serving the checkpoint, and an SDK client for it."""
    inprocess = sys.modules["pdd_test_inprocess"]  # loaded by path in this folder's conftest
    checkpoint = write_checkpoint(tmp_path, request.param)
    model = load_model(str(checkpoint))
    specs = [
        WorkerSpec("p", "prefill"),
        WorkerSpec("rld", "relay", wan_facing=True),
        WorkerSpec("md", "main", wan_facing=True),
    ]
    async with inprocess.InProcessCluster(
        model, specs, LinkSpec(gbps=1.0, rtt_ms=4.0), block_size=BLOCK, num_blocks=256
    ) as cluster:
        workers = ((Role.PREFILL, "p"), (Role.RELAY, "rld"), (Role.MAIN, "md"))
        async with (
            cluster.router(workers, model=str(checkpoint)) as runtime,
            cluster.openai_client(runtime, ROUTER) as client,
        ):
            yield request.param, runtime, client


async def forced_call(client: openai.AsyncOpenAI, stream: bool, **kwargs):
    """The one choice (its message and finish reason), non-streaming or as the SDK's
    stream accumulator builds it; a stream must carry the call in several chunks (the
    name first, then the arguments as they are written)."""
    common = {"messages": [USER], "tools": TOOLS, "max_tokens": 120, "temperature": 1.0}
    if not stream:
        response = await client.chat.completions.create(**common, **kwargs)
        return response.choices[0]
    call_chunks = 0
    async with client.chat.completions.stream(**common, **kwargs) as events:
        async for event in events:
            if event.type == "chunk" and event.chunk.choices:
                call_chunks += bool(event.chunk.choices[0].delta.tool_calls)
        choice = (await events.get_final_completion()).choices[0]
    assert call_chunks > 2
    return choice


async def test_a_forced_call_comes_back_as_tool_calls(stack) -> None:
    name, runtime, client = stack
    assert runtime.tool_call_format is MODELS[name][3]  # detected from the template
    model = runtime.config.served_name
    named = {"type": "function", "function": {"name": "get_time"}}
    cases = [
        ({"tool_choice": named}, "get_time", ZONE),
        ({"tool_choice": "required", "parallel_tool_calls": False}, None, None),
    ]
    for seed, (stream, (choice, want, schema)) in enumerate(
        (s, c) for s in (False, True) for c in cases
    ):
        got = await forced_call(client, stream, model=model, seed=seed, **choice)
        assert got.finish_reason == "tool_calls", (name, stream, got)
        [call] = got.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == (want or call.function.name)
        args = json.loads(call.function.arguments)
        expected = schema or {"get_weather": CITY, "get_time": ZONE}[call.function.name]
        [key] = expected["required"]
        assert list(args) == [key] and args[key] in expected["properties"][key]["enum"]

    # The call and its result go back through the template in the next turn.
    assistant = got.message.model_dump(exclude_none=True)
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    turn2 = await client.chat.completions.create(
        model=model, messages=[USER, assistant, result], tools=TOOLS, max_tokens=4
    )
    function = assistant["tool_calls"][0]["function"]
    decoded = {**function, "arguments": json.loads(function["arguments"])}
    history = {**assistant, "tool_calls": [{**assistant["tool_calls"][0], "function": decoded}]}
    prompt = runtime.tokenizer.chat_ids([USER, history, result], True, TOOLS)
    assert turn2.usage.prompt_tokens == len(prompt)
    shown = {"qwen3": "<tool_response>\nsunny\n</tool_response>", "llama31": '"sunny"<|eot_id|>'}
    assert shown[name] in runtime.tokenizer.tokenizer.decode(prompt)
