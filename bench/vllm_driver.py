"""The vLLM side of ``bench/engine.py --baseline vllm``, run by vLLM's own interpreter.

    VLLM_PYTHON bench/vllm_driver.py SETTINGS_JSON

It imports only vLLM and the standard library, so vLLM lives in a virtual environment of
its own and our environment never imports it (their torch builds and pins differ).
``bench/vllm_baseline.py`` starts it and talks to it over stdin/stdout, one JSON object a
line: the driver builds the ``LLM`` once (torch.compile and all), warms it up and says
``ready``; then each ``generate`` command runs token-id prompts greedily with EOS ignored
from a cold prefix cache and answers the seconds it took and the tokens. Answer lines
start with ``MARKER`` because vLLM logs to stdout too. The timing is taken here, around
``LLM.generate`` alone, so the pipe never counts.
"""

from __future__ import annotations

import json
import sys
import time

MARKER = "PDD-VLLM "


def reply(obj: dict) -> None:
    print(MARKER + json.dumps(obj), flush=True)


def build(settings: dict):
    """The LLM on the bench's checkpoint, with the same limits as our engine's."""
    from vllm import LLM

    return LLM(
        model=settings["checkpoint"],
        skip_tokenizer_init=True,  # prompts are token ids; the checkpoint's BPE is a stand-in
        dtype=settings["dtype"],
        max_model_len=settings["max_model_len"],
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        seed=settings["seed"],
    )


def generate(llm, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in max_tokens
    ]
    llm.reset_prefix_cache()  # every call starts cold, as ours does
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def main() -> None:
    with open(sys.argv[1]) as f:
        settings = json.load(f)
    llm = build(settings)
    generate(llm, [list(range(3, 19))], [4])  # warm-up, as the bench warms ours
    import torch
    import vllm

    reply({"vllm": vllm.__version__, "torch": torch.__version__})  # ready
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        reply(generate(llm, command["prompts"], command["max_tokens"]))


if __name__ == "__main__":
    main()
