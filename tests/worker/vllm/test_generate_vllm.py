"""``pdd generate --engine vllm``, the installed command, doing P's and MD's moves by hand
on the real SmolLM2-135M-Instruct (float32, greedy):

- P: the prompt, 24 greedy tokens, its KV exported to a store (``--export-kv``). This run
  is also the uninterrupted reference (exporting reads the KV, it changes no token).
- MD: a fresh vLLM given P's prompt IDs plus the first K = 8 generated IDs, importing
  P's KV (``--import-kv``): it computes exactly those 8 tokens (``num_cached_tokens`` in
  its JSON is P's prompt length) and continues token-equal to P's run.

P runs blocks of 128 tokens, MD blocks of 32. Two vLLM starts, one after the other, with
``--enforce-eager`` (no compiled graphs, no warm-up). Slow; skipped without vLLM (the
``pdd[vllm]`` extra) or without the pulled model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import MAX_TOKENS, VLLM_ENV, VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PDD = Path(sys.executable).with_name("pdd")
HANDED_OVER = 8
PROMPT = (
    "Explain, step by step, how a hash map handles collisions with open addressing and with "
    "separate chaining. Compare their memory use, their behaviour as the load factor grows, "
    "and what happens on deletion in each. Then say which one you would pick for a cache of "
    "short-lived session objects keyed by random 128-bit identifiers, where reads outnumber "
    "writes ten to one, and why."
)


def pdd_generate(*argv: str) -> dict[str, Any]:
    """One ``pdd generate --engine vllm --json`` run: one vLLM start, KV space 1 GiB."""
    env = {**os.environ, **VLLM_ENV}
    command = [str(PDD), "generate", "--engine", "vllm", "--enforce-eager", "--json", *argv]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    store = tmp_path_factory.mktemp("kv-store")
    common = ["--model", str(model), "--kv-store", str(store), "--ignore-eos"]
    p = pdd_generate(
        *common, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS),
        "--export-kv", "req-1", "--block-size", "128",
    )  # fmt: skip
    handed = p["prompt_token_ids"] + p["token_ids"][:HANDED_OVER]
    md = pdd_generate(
        *common, "--prompt-ids", ",".join(map(str, handed)),
        "--max-tokens", str(MAX_TOKENS - HANDED_OVER), "--import-kv", "req-1",
        "--block-size", "32",
    )  # fmt: skip
    return {"p": p, "md": md}


def test_p_exports_its_whole_prompt(runs: dict[str, dict[str, Any]]) -> None:
    p = runs["p"]
    assert len(p["prompt_token_ids"]) > 64 and len(p["token_ids"]) == MAX_TOKENS
    assert p["kv_transfer_params"] == {"pdd_exported_tokens": len(p["prompt_token_ids"])}


def test_md_computes_only_the_handed_over_tokens_and_continues_as_p(
    runs: dict[str, dict[str, Any]],
) -> None:
    p, md = runs["p"], runs["md"]
    prompt = len(p["prompt_token_ids"])
    assert md["prompt_token_ids"] == p["prompt_token_ids"] + p["token_ids"][:HANDED_OVER]
    assert len(md["prompt_token_ids"]) - md["num_cached_tokens"] == HANDED_OVER
    assert md["kv_transfer_params"] == {"pdd_imported_tokens": prompt}
    assert md["token_ids"] == p["token_ids"][HANDED_OVER:]
