"""Penalties and ``min_tokens`` across a handoff on the real vLLM: what MD's vLLM gets after
one (the prompt + the handed-over IDs, ``prior_output_tokens`` of them) continues token
for token as vLLM alone does, on SmolLM2-135M-Instruct in float32, greedy.

MD's KV arrives through the connector, which changes no logit (``test_connector.py``,
``test_vllm_pipelines.py``); what a handoff changes for sampling is that vLLM sees the
earlier output as prompt. So one vLLM instance, started by PDD's engine arguments (with
``PriorOutputPenalties``), runs each prompt alone and then its resumed half, with the
sampling arguments the role engine gives it (``vllm_sampling_kwargs``). The control
shows the test can fail: vLLM given the penalties itself (the old mapping) forks.

Slow; skipped without vLLM (the ``pdd[vllm]`` extra) or without the pulled model.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

try:
    import vllm
except ImportError:
    pytest.skip(
        "vLLM is not installed: `./scripts/setup.sh --with-vllm` (the pdd[vllm] extra, in "
        ".venv-vllm) runs these",
        allow_module_level=True,
    )

from pdd.common.model_store import DEFAULT_MODEL, cached
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.vllm.engine_args import VllmEngineSettings, engine_kwargs
from pdd.worker.vllm.sampling import vllm_sampling_kwargs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS, HANDED_OVER = 32, 8
PROMPTS = [
    "List ten fruits, one per line, and say which of them you like best and why.",
    "Write a short poem about the sea, the wind and a small boat coming home at night.",
    "Explain how a hash map handles collisions, and compare open addressing with chaining.",
]
PENALIZED = {
    "presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.2,
    "min_tokens": MAX_TOKENS - 4,
}  # fmt: skip


@pytest.fixture(scope="module")
def llm() -> Iterator[vllm.LLM]:
    model_dir = cached(DEFAULT_MODEL)
    if model_dir is None:
        pytest.skip(f"{DEFAULT_MODEL} is not pulled: run `pdd models pull {DEFAULT_MODEL}`")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    settings = VllmEngineSettings(
        model=str(model_dir), dtype="float32", block_size=32, max_model_len=1024,
        max_num_seqs=4, enforce_eager=True, seed=0,
    )  # fmt: skip
    engine = vllm.LLM(**engine_kwargs(settings))
    try:
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()


def run(llm: vllm.LLM, prompts: list[list[int]], kwargs: list[dict]) -> list[list[int]]:
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    params = [vllm.SamplingParams(**k) for k in kwargs]
    return [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)]


def test_a_handed_over_request_with_penalties_and_min_tokens_is_vllm_alone(
    llm: vllm.LLM,
) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    whole = SamplingParams(max_tokens=MAX_TOKENS, **PENALIZED)
    alone = run(llm, prompts, [vllm_sampling_kwargs(whole)] * len(prompts))
    assert all(len(out) > HANDED_OVER for out in alone)

    handed = [[*ids, *out[:HANDED_OVER]] for ids, out in zip(prompts, alone, strict=True)]
    resumed = whole.with_changes(
        max_tokens=MAX_TOKENS - HANDED_OVER, prior_output_tokens=HANDED_OVER
    )
    md = run(llm, handed, [vllm_sampling_kwargs(resumed)] * len(prompts))
    assert md == [out[HANDED_OVER:] for out in alone]

    # The control: vLLM applying the penalties itself counts only its own output.
    penalties = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    naive = {**vllm_sampling_kwargs(resumed), **{k: PENALIZED[k] for k in penalties}}
    naive["extra_args"] = None
    forked = run(llm, handed, [naive] * len(prompts))
    assert forked != md
