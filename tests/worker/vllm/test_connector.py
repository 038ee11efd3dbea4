"""PDD's three KV moves with vLLM as the engine (pdd.worker.vllm.connector), on the real
SmolLM2-135M-Instruct in float32, greedy, against vLLM run alone:

(a) a P instance (max_tokens 1) exports each prompt's KV as PDD chunks;
(b) a fresh instance imports a prompt's KV and decodes, computing one token;
(c) a fresh instance given prompt + the first K=8 ids another instance decoded imports
    the prompt's KV, computes exactly those 8 tokens (vLLM's own count of the tokens it
    did not compute: ``num_cached_tokens``) and continues token-equal to the
    uninterrupted run.

P runs blocks of 128 tokens, the decode instance blocks of 32: the chunks are PDD's
per-token format, so the block size (and vLLM's packing of a block) may differ between
the two. The decode instance runs (c) first, from an empty cache, then (b), where its
prefix cache holds the prompts' full blocks from (c) and the connector loads the rest.
Two vLLM instances, one after the other (each takes seconds to start and ~4 GiB).

Slow; skipped without vLLM (the ``pdd[vllm]`` extra) or without the pulled model.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import VLLM_ENV, VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

import vllm

from pdd.worker.vllm.engine_args import VllmEngineSettings, engine_kwargs
from pdd.worker.vllm.params import export_params, import_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS, HANDED_OVER = 32, 8
PROMPTS = [
    "Explain, step by step, how a hash map handles collisions with open addressing and "
    "with separate chaining. Compare their memory use, their behaviour as the load factor "
    "grows, and what happens on deletion in each. Then say which one you would pick for a "
    "cache of short-lived session objects keyed by random 128-bit identifiers, where reads "
    "outnumber writes ten to one, and why. Keep the answer practical: name the pitfalls a "
    "junior engineer would hit in the first week of running it in production, and how "
    "they would notice each one from the service's latency and memory metrics before a "
    "customer does.",
    "I am planning a three-day walking trip through the hills north of a small town. The "
    "paths are marked, but there is little mobile coverage, the nights are cold, and water "
    "sources are about fifteen kilometres apart. I will carry everything myself. Write me a "
    "packing list grouped by purpose (shelter, water, food, navigation, first aid, clothing), "
    "with a one-line reason for each item, and tell me which three items I should never "
    "leave behind even if my pack is too heavy. Also suggest how to split the food across "
    "the days so that the heaviest part is eaten first, and what to do if the weather turns "
    "on the second afternoon while I am far from the next village.",
    "Write a short story about a lighthouse keeper on a remote northern island who, on the "
    "last evening before the lighthouse is automated and she must leave, finds a message in a "
    "bottle addressed to the keeper who held the post fifty years earlier. The story should "
    "have three scenes: the discovery at low tide, the night she spends reading the old logs "
    "to find out who the writer was, and the morning the supply boat arrives. Keep the tone "
    "quiet and concrete, with the sea, the lamp and the weather doing most of the work, "
    "and end it without saying whether she ever answers the letter or keeps it to herself.",
]


def start(model: Path, store: Path, block_size: int) -> vllm.LLM:
    """A vLLM instance with the PDD connector, float32, 1 GiB of KV, on the test's cores."""
    for name, value in VLLM_ENV.items():
        os.environ.setdefault(name, value)
    settings = VllmEngineSettings(
        model=str(model), dtype="float32", block_size=block_size, max_model_len=1024,
        max_num_seqs=4, enable_prefix_caching=True, seed=0, kv_store_dir=store,
    )  # fmt: skip
    return vllm.LLM(**engine_kwargs(settings))


def stop(llm: vllm.LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


def generate(
    llm: vllm.LLM, prompts: list[list[int]], max_tokens: int, transfers: list[dict[str, Any]]
) -> list[Any]:
    params = [
        vllm.SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            extra_args={"kv_transfer_params": transfer} if transfer else None,
        )
        for transfer in transfers
    ]
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    return llm.generate(inputs, params, use_tqdm=False)


@pytest.fixture(scope="module")
def prefill(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """vLLM alone (32 tokens each), then the same instance as P (max_tokens 1, export)."""
    store = tmp_path_factory.mktemp("kv-store")
    llm = start(model, store, block_size=128)
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    add_generation_prompt=True,
                    tokenize=False,
                ),
                add_special_tokens=False,
            )
            for text in PROMPTS
        ]
        alone = generate(llm, prompts, MAX_TOKENS, [{}] * len(prompts))
        keys = [f"req-{i}" for i in range(len(prompts))]
        exported = generate(llm, prompts, 1, [export_params(k) for k in keys])
    finally:
        stop(llm)
    yield {
        "store": store,
        "prompts": prompts,
        "keys": keys,
        "alone": [list(o.outputs[0].token_ids) for o in alone],
        "exported": exported,
    }


@pytest.fixture(scope="module")
def decode(model: Path, prefill: dict) -> dict:
    """A fresh instance: (c) the handoffs first, from an empty cache, then (b)."""
    prompts, keys, alone = prefill["prompts"], prefill["keys"], prefill["alone"]
    llm = start(model, prefill["store"], block_size=32)
    try:
        handed = [p + out[:HANDED_OVER] for p, out in zip(prompts, alone, strict=True)]
        imports = [import_params(k, len(p)) for k, p in zip(keys, prompts, strict=True)]
        handoff = generate(llm, handed, MAX_TOKENS - HANDED_OVER, imports)
        resumed = generate(llm, prompts, MAX_TOKENS, imports)
    finally:
        stop(llm)
    return {"handoff": handoff, "resumed": resumed}


def test_prompts_are_chat_turns_of_150_to_300_tokens(prefill: dict) -> None:
    assert [150 <= len(p) <= 300 for p in prefill["prompts"]] == [True] * len(PROMPTS)


def test_p_exports_every_prompt_token(prefill: dict) -> None:
    """(a) P's output says it exported the whole prompt, and the chunks are in the store."""
    for prompt, key, out, alone in zip(
        prefill["prompts"], prefill["keys"], prefill["exported"], prefill["alone"], strict=True
    ):
        assert out.kv_transfer_params == {"pdd_exported_tokens": len(prompt)}
        assert list(out.outputs[0].token_ids) == alone[:1]
        assert any((prefill["store"] / key).glob("*.kv"))


def test_handoff_computes_only_the_handed_over_tokens(prefill: dict, decode: dict) -> None:
    """(c) The prompt's KV is imported, the 8 handed-over ids are the only tokens computed,
    and the answer goes on exactly as the uninterrupted run's."""
    for prompt, alone, out in zip(
        prefill["prompts"], prefill["alone"], decode["handoff"], strict=True
    ):
        computed = len(prompt) + HANDED_OVER - out.num_cached_tokens
        assert computed == HANDED_OVER
        assert out.kv_transfer_params["pdd_imported_tokens"] > 0
        assert list(out.outputs[0].token_ids) == alone[HANDED_OVER:]


def test_import_then_decode_computes_one_token(prefill: dict, decode: dict) -> None:
    """(b) With the prompt's full blocks cached from (c), the connector loads the rest of
    the prompt but its last token, which vLLM computes to sample from."""
    for prompt, alone, out in zip(
        prefill["prompts"], prefill["alone"], decode["resumed"], strict=True
    ):
        assert len(prompt) - out.num_cached_tokens == 1
        imported = (out.kv_transfer_params or {}).get("pdd_imported_tokens", 0)
        assert imported == (len(prompt) - 1) % 32
        assert list(out.outputs[0].token_ids) == alone
