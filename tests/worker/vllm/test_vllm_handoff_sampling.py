"""Sampling state across the handoff on vLLM (issue 56, point 3): ``pdd up --engine vllm
--mode pdd`` on the real SmolLM2-135M-Instruct (float32, eager), against vLLM run alone
with the same sampling parameters.

- Penalties and ``min_tokens`` (presence, frequency and repetition penalties, EOS masked
  until 20 of 24 tokens, greedy), planned through P-RLD-MD and P-MD as the router plans
  them: token-equal to vLLM alone, while MD's vLLM computes only the handed-over IDs (so
  the handoff happened and MD carried the earlier output's penalties and count).
- A seeded request at temperature > 0, through the router: it goes P-MD with MD computing
  its miss (rule ``vllm_one_sampler``, said in ``x-pdd-reason``), and answers what vLLM
  alone answers with that seed.

One offline vLLM for the reference, then the stack (three vLLM instances), one after the
other. Slow; skipped without vLLM (the ``pdd[vllm]`` extra) or without the pulled model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .conftest import CONVERSATIONS, MAX_TOKENS, VLLM_ENV, VLLM_MISSING, WORKER_FLAGS

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pdd.common.wire import SamplingSpec
from pdd.local.stack import LocalStack
from pdd.router.tokenization import load_prompt_tokenizer
from pdd.testing.pipelines import QUESTIONS, md_computed, start_stack, through_workers
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.vllm.engine_args import VllmEngineSettings, engine_kwargs
from pdd.worker.vllm.sampling import vllm_sampling_kwargs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

SECRET = "vllm-handoff-sampling-secret"
PENALIZED = SamplingSpec(
    max_tokens=MAX_TOKENS, temperature=0.0, presence_penalty=0.6, frequency_penalty=0.4,
    repetition_penalty=1.2, min_tokens=MAX_TOKENS - 4,
)  # fmt: skip
SEEDED = {"temperature": 0.8, "seed": 11}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass(frozen=True)
class Alone:
    """What vLLM alone answers: each question penalized (IDs), the chat seeded (text)."""

    questions: list[list[int]]
    penalized: list[list[int]]
    seeded_text: str


@pytest.fixture(scope="module")
def alone(model: Path) -> Alone:
    """vLLM run alone, before the stack starts (so never four instances at once)."""
    import vllm

    tokenizer = load_prompt_tokenizer(model)
    value = json.loads((model / "generation_config.json").read_text())["eos_token_id"]
    eos = set(value if isinstance(value, list) else [value])
    questions = [
        tokenizer.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS[:CONVERSATIONS]
    ]
    penalized = vllm_sampling_kwargs(SamplingParams.of(PENALIZED))
    seeded = vllm_sampling_kwargs(SamplingParams(max_tokens=MAX_TOKENS, **SEEDED))
    prompts = [*questions, tokenizer.chat_ids(CHAT)]
    params = [*([penalized] * len(questions)), seeded]
    settings = VllmEngineSettings(
        model=str(model), dtype="float32", enforce_eager=True, block_size=32,
        max_model_len=2048, kv_cache_memory_bytes=1 << 30, seed=0,
    )  # fmt: skip
    llm = vllm.LLM(**engine_kwargs(settings))
    try:
        outs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts],
            [vllm.SamplingParams(**p) for p in params],
            use_tqdm=False,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    *answers, said = [list(out.outputs[0].token_ids) for out in outs]
    text_ids = said[:-1] if said and said[-1] in eos else said
    return Alone(questions, answers, tokenizer.tokenizer.decode(text_ids))


@pytest.fixture(scope="module")
def stack(
    model: Path, alone: Alone, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    """``pdd up --engine vllm --mode pdd`` as the CLI builds it; started once vLLM alone
    has answered (``alone``)."""
    argv = ["--model", str(model), "--engine", "vllm", "--ready-timeout-s", "1500"]
    argv += [f"--worker-arg={f}" for f in WORKER_FLAGS]
    env = {**VLLM_ENV, "PDD_SHARED_SECRET": SECRET}
    started = start_stack(argv, "pdd", tmp_path_factory.mktemp("stack"), env)
    try:
        yield started
    finally:
        started.stop()


@pytest.mark.parametrize("pipeline", ["P-RLD-MD", "P-MD"])
def test_penalties_and_min_tokens_across_the_handoff_are_vllm_alones(
    stack: LocalStack, alone: Alone, pipeline: str
) -> None:
    got = asyncio.run(
        through_workers(stack, SECRET, alone.questions, pipeline, MAX_TOKENS, PENALIZED)
    )
    mismatched = [i for i, (g, w) in enumerate(zip(got, alone.penalized, strict=True)) if g != w]
    assert not mismatched, f"{len(mismatched)}/{len(got)} differ: {mismatched}"
    # A handoff happened: MD's vLLM computed only the handed-over IDs (the rest loaded).
    computed = md_computed(Path(stack.info.log_dir) / "pdd-main-0.log", len(got), f"eq-{pipeline}-")
    assert len(computed) == len(got), computed
    assert all(1 <= c <= MAX_TOKENS < p for c, p in computed), computed


def test_a_seeded_request_goes_where_one_vllm_samples_it_as_vllm_alone(
    stack: LocalStack, model: Path, alone: Alone
) -> None:
    body = {"model": model.name, "messages": CHAT, "max_tokens": MAX_TOKENS, **SEEDED}
    answer = httpx.post(f"{stack.info.router_url}/v1/chat/completions", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    reason = answer.headers["x-pdd-reason"]
    assert answer.headers["x-pdd-pipeline"] == "P-MD" and "seeded" in reason, reason
    assert answer.json()["choices"][0]["message"]["content"] == alone.seeded_text
