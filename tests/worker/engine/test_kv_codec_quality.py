"""The WAN codecs' quality on checkpoints transformers wrote (Llama, Qwen2, Qwen3 shapes).

Greedy, 64 generated tokens per prompt, against the same model with exact KV (see
``bench/kv_codec_quality.py``, the measure bench/kv_codec.py reports, for the views).
int8 must keep 99% of the tokens under teacher forcing; fp8 and int4 are held to
looser bounds that still catch a broken codec (a wrong scale or a swapped nibble is off
by far more). The free-running agreement is reported by bench/kv_codec.py, not asserted: on these
random-weight models one near-tie changes every token after it. What is asserted is
that int8's free runs (the engine's own export and import) leave the exact one only
at near-ties: a broken coded transfer would flip clear decisions too.

On checkpoints trained on the synthetic corpus (``tests/worker/checkpoints.py``),
whose top two logits are rarely tied, int8 must keep 99% of the tokens free-running
too: the issue's bar, on the engine's export and import. The same bar through whole
stacks (router, P, MD, the WAN line), against mono: ``tests/bench/test_greedy_agreement.py``.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pdd.worker.engine.kv_codec import fp8_supported
from pdd.worker.model.loader import load_model

# The measure is benchmark code (bench/), loaded by path: bench/ is not a package.
_spec = importlib.util.spec_from_file_location(
    "kv_codec_quality", Path(__file__).parents[3] / "bench" / "kv_codec_quality.py"
)
kv_codec_quality = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = kv_codec_quality  # its dataclasses look their module up
_spec.loader.exec_module(kv_codec_quality)
CodecQuality, measure = kv_codec_quality.CodecQuality, kv_codec_quality.measure

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
#: codec -> (least teacher-forced agreement, largest mean KL in nats, largest next-token
#: logit error). Measured on these checkpoints: int8 >= 0.996, KL <= 7.4e-7, error <=
#: 0.0061; fp8 >= 0.992, 2.3e-5, 0.034; int4 >= 0.961, 2.3e-4, 0.146. The one scale per
#: 64 tokens these codecs had before measured int8 KL up to 1.9e-6 and int4 up to 6.6e-4.
#: An exact top-2 logit margin int8 may flip: its error moves that gap by about 0.0015
#: (RMS) on these checkpoints, and the median margin is about 0.2.
NEAR_TIE = 0.02
BOUNDS = {"int8": (0.99, 4e-6, 0.03), "fp8": (0.97, 1e-4, 0.1), "int4": (0.93, 1e-3, 0.5)}


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 320) for _ in range(rng.randrange(60, 120))] for _ in range(4)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_int8_keeps_99_percent_of_greedy_tokens(
    hf_checkpoint: Callable[..., Path], arch: str
) -> None:
    q = check(load_model(str(hf_checkpoint(arch)), dtype="float32"), "int8")
    assert all(margin < NEAR_TIE for margin in q.flip_margins)


@pytest.mark.timeout(1800)  # trains its checkpoint: a minute of CPU, 12 when loaded
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_int8_keeps_99_percent_free_running_on_trained_checkpoints(
    trained_checkpoint: Callable[[str], Path], corpus_prompts: list[list[int]], arch: str
) -> None:
    loaded = load_model(str(trained_checkpoint(arch)), dtype="float32")
    q = measure(loaded, corpus_prompts, "int8", MAX_TOKENS)
    assert q.free_agreement >= 0.99
    assert q.forced_agreement >= 0.99
    assert 0 < q.kl <= BOUNDS["int8"][1]
    # Trained distributions are peaked: nine positions in ten have a top-2 margin more
    # than ten times the RMS change int8 makes to that gap (measured: 49-199 times).
    assert q.gap_shift_rms < q.margin_quantile(0.1) / 10


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_fp8_and_int4_stay_within_their_bounds(
    hf_checkpoint: Callable[..., Path], codec: str
) -> None:
    if codec == "fp8" and not fp8_supported():
        pytest.skip("this torch has no float8_e4m3fn")
    check(load_model(str(hf_checkpoint("qwen3")), dtype="float32"), codec)


def check(loaded, codec: str) -> CodecQuality:
    least, most_kl, most_error = BOUNDS[codec]
    q = measure(loaded, prompts(0), codec, MAX_TOKENS)  # type: ignore[arg-type]
    assert q.total == 4 * MAX_TOKENS
    assert q.forced_agreement >= least
    assert 0 < q.kl <= most_kl  # 0 would mean the codec was not applied at all
    assert 0 < q.next_max_abs <= most_error
    return q
