"""A lossy WAN KV codec, end to end: mono's greedy tokens against pdd's, through the router.

The issue's bar for ``spec.wan.kvCodec: int8``: at most 0.52x of ``none``'s WAN KV bytes,
and at least 99% of mono's greedy tokens on the test checkpoints. Here on the trained
Qwen3 test checkpoint (``tests/worker/checkpoints.py``: its next-token choices are
peaked, as a served model's are) with held-out prompts from its corpus, sent as token
IDs: three stacks rendered by the operator as ``pdd up`` runs them (mono; pdd with
``none``; pdd with ``int8``), the KV of every prompt crossing the emulated WAN line to MD.

Why Qwen3: the training runs on whatever CPU runs the suite, and its float sums differ
from one CPU to another, so the trained weights do too. The trained Llama keeps a few
near-ties (1% of its top-2 margins under 0.013, the closest 0.002), which int8 (a gap
change of about 0.004 RMS) would flip on some CPU's training; Qwen3's 1% quantile is
0.12, thirty times int8's change, so the verdict does not depend on the machine.
``bench/kv_codec.py --stack`` measures all three (100% with int8 on each, here).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest

from pdd.bench.greedy_agreement import StackGreedy, run_greedy
from pdd.common.cost_model import kv_bytes_per_token
from pdd.common.vocabulary import Pipeline
from pdd.local.cluster import free_port
from pdd.local.topology import StackConfig

pytestmark = pytest.mark.slow

# Loaded by path: with --import-mode=importlib the tests folder is not on sys.path.
_spec = importlib.util.spec_from_file_location(
    "pdd_test_checkpoints", Path(__file__).parents[1] / "worker" / "checkpoints.py"
)
checkpoints = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checkpoints)

PROMPTS = 8
MAX_TOKENS = 64
SHAPE = checkpoints.BASE_CONFIG
#: Bytes a token's KV takes on the WAN, float32 checkpoint (2 layers, 2 KV heads, dim 16).
RAW, INT8 = (
    kv_bytes_per_token(
        SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"], SHAPE["head_dim"], 4, codec
    )
    for codec in ("none", "int8")
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], StackGreedy]:
    """``run(mode, codec)``: the held-out prompts through that stack, on the trained Qwen3."""
    model = checkpoints.train_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3")
    prompts = checkpoints.corpus_prompts(SHAPE["vocab_size"], PROMPTS)

    def stack(mode: str, codec: str) -> StackGreedy:
        logs = tmp_path_factory.mktemp(f"{mode}-{codec}")
        # MD computing a miss would send no KV: the codec would have nothing to code.
        config = StackConfig(mode=mode, model=str(model), port=free_port(), log_dir=logs,
                             kv_codec=codec, router_args=("--md-recompute-max-tokens=0",),
                             )  # type: ignore[arg-type]  # fmt: skip
        return run_greedy(config, prompts, MAX_TOKENS)

    return stack


@pytest.mark.timeout(1800)  # trains its checkpoint and starts three stacks
def test_int8_on_the_wan_keeps_99_percent_of_monos_tokens_at_half_the_bytes(
    run: Callable[[str, str], StackGreedy],
) -> None:
    mono, exact, coded = run("mono", "none"), run("pdd", "none"), run("pdd", "int8")
    assert [len(o) for o in mono.outputs] == [MAX_TOKENS] * PROMPTS
    assert set(mono.pipelines) == {Pipeline.MONO}
    for pdd in (exact, coded):  # every prompt's KV crossed to MD
        assert set(pdd.pipelines) <= {Pipeline.P_MD, Pipeline.P_RLD_MD}
        assert pdd.wan_kv_bytes > 0
    # Exact KV over the WAN changes no token; int8 may flip a near-tie, rarely.
    assert exact.outputs == mono.outputs
    agreement = coded.agreement_with(mono)
    assert agreement is not None and agreement >= 0.99
    # The same miss crossed both times; int8 sent its codes and scales, not the floats.
    assert coded.wan_kv_bytes == exact.wan_kv_bytes
    ratio = coded.wan_kv_wire_bytes / exact.wan_kv_wire_bytes
    assert INT8 / RAW <= ratio <= 0.52
