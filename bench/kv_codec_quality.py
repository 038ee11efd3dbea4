"""What a KV codec costs in quality, measured on a loaded model (bench/kv_codec.py,
bench/real_model.py and tests/worker/engine/test_kv_codec_quality.py).

All against the same model with exact KV, greedy, after a prompt whose KV went
through the codec (what MD holds after a coded transfer; the tokens MD then
generates get exact KV of its own computing):

* logits: the next token's (max and mean absolute error), and the KL divergence of
  the coded distribution from the exact one, averaged over the generated positions;
* teacher-forced agreement: at each position of the exact greedy continuation, with
  that same history, does the coded side pick the same token? Each position is
  judged on its own, so one near-tie does not count as every token after it;
* free-running agreement: the P -> MD path itself (export coded, import, decode),
  position by position against the exact transfer's tokens. A single flip changes
  everything after it, so this is the strict view; small random-weight models,
  whose top two logits are often close, flip easily here;
* flip margins: where a free run first leaves the exact one, how far apart the exact
  top two logits were there (a flip at a near-tie, not a codec that went wrong);
* teacher-forced flips against the margins of every position: at each position the
  exact top-1 minus top-2 logit (the margin) and how far the codec moved that gap
  (the gap shift). A flip needs a shift larger than the margin, so whether flips are
  "near-ties" is read off these two distributions rather than assumed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.common.kv_codec import KVCodec
from pdd.worker.engine.engine import Engine
from pdd.worker.engine.kv_codec import decode, encode
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.batch import ForwardBatch, SeqInput
from pdd.worker.model.kv_cache import PagedKVCache
from pdd.worker.model.loader import LoadedModel


@dataclass(frozen=True)
class ForcedFlip:
    """A teacher-forced position where the coded side picks another token than exact."""

    margin: float  # exact top-1 minus top-2 logit there
    gap_shift: float  # coded minus exact value of that same gap (negative: narrowed)
    max_abs: float  # largest absolute logit error the codec made there
    rank: float  # share of all positions whose exact margin is smaller


@dataclass(frozen=True)
class CodecQuality:
    """One codec on a set of prompts."""

    next_max_abs: float  # next token's logits: largest absolute error over prompts
    next_mean_abs: float  # ... mean absolute error
    kl: float  # mean over prompts and positions of KL(exact || coded), nats
    forced_matching: int  # teacher-forced positions where the coded side picks the same
    free_matching: int  # free-running positions equal to the exact transfer's
    total: int  # generated positions (per view)
    flip_margins: tuple[float, ...]  # exact top-1 minus top-2 logit where a free run left
    margins: tuple[float, ...]  # exact top-1 minus top-2 logit at every forced position
    gap_shifts: tuple[float, ...]  # the codec's change of that gap at every forced position
    forced_flips: tuple[ForcedFlip, ...]

    @property
    def forced_agreement(self) -> float:
        return self.forced_matching / self.total

    @property
    def free_agreement(self) -> float:
        return self.free_matching / self.total

    @property
    def gap_shift_rms(self) -> float:
        """RMS of the codec's change of the exact top-2 gap (what decides a near-tie)."""
        return (sum(g * g for g in self.gap_shifts) / len(self.gap_shifts)) ** 0.5

    def margin_quantile(self, q: float) -> float:
        """The ``q`` quantile (0-1) of the exact top-2 margins over forced positions."""
        ordered = sorted(self.margins)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    loaded: LoadedModel, prompts: Sequence[Sequence[int]], codec: KVCodec, max_tokens: int
) -> CodecQuality:
    """Every view above for ``codec`` over ``prompts``, ``max_tokens`` generated each."""
    next_max = next_mean = kl = 0.0
    forced = free = 0
    flip_margins: list[float] = []
    margins: list[float] = []
    shifts: list[float] = []
    flips: list[tuple[float, float, float]] = []
    for prompt in prompts:
        exact_run = transferred_generation(loaded, prompt, "none", max_tokens)
        exact, coded = _forced_logits(loaded, prompt, exact_run, codec)
        diff = (coded[0] - exact[0]).abs()
        next_max = max(next_max, diff.max().item())
        next_mean += diff.mean().item() / len(prompts)
        p_log, q_log = exact.log_softmax(-1), coded.log_softmax(-1)
        kl += (p_log.exp() * (p_log - q_log)).sum(-1).mean().item() / len(prompts)
        forced += int((exact.argmax(-1) == coded.argmax(-1)).sum().item())
        margin, shift, flipped = _gaps(exact, coded)
        margins += margin.tolist()
        shifts += shift.tolist()
        worst = (coded - exact).abs().amax(-1)
        flips += [(margin[i].item(), shift[i].item(), worst[i].item()) for i in flipped]
        coded_run = transferred_generation(loaded, prompt, codec, max_tokens)
        same = [a == b for a, b in zip(exact_run, coded_run, strict=True)]
        free += sum(same)
        if not all(same):  # both runs had the same history up to there: exact's row holds
            top = exact[same.index(False)].topk(2).values
            flip_margins.append((top[0] - top[1]).item())
    total = len(prompts) * max_tokens
    ranked = sorted(margins)
    forced_flips = tuple(
        ForcedFlip(m, g, w, bisect.bisect_left(ranked, m) / len(ranked)) for m, g, w in flips
    )
    return CodecQuality(
        next_max, next_mean, kl, forced, free, total, tuple(flip_margins), tuple(margins),
        tuple(shifts), forced_flips,
    )  # fmt: skip


def _gaps(exact: torch.Tensor, coded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Per position: the exact top-2 margin, the codec's change of that same gap (the
    two tokens exact ranks first and second), and the positions whose argmax differs."""
    top = exact.topk(2)
    margin = top.values[:, 0] - top.values[:, 1]
    coded_gap = coded.gather(-1, top.indices[:, :1]) - coded.gather(-1, top.indices[:, 1:])
    flipped = (exact.argmax(-1) != coded.argmax(-1)).nonzero().flatten().tolist()
    return margin, coded_gap.squeeze(-1) - margin, flipped


def transferred_generation(
    loaded: LoadedModel, prompt: Sequence[int], codec: KVCodec, max_tokens: int
) -> list[int]:
    """P's prefill, its KV exported ``codec``-coded and imported by a second engine, which
    decodes greedily: the tokens a P-MD request streams."""
    blocks = 2 * -(-(len(prompt) + max_tokens) // DEFAULT_BLOCK_SIZE)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sender = Engine(loaded, block_size=DEFAULT_BLOCK_SIZE, num_blocks=blocks)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rid = sender.add_request(prompt, one, hold_kv=True)
    (first,) = [t for out in _drain(sender) for t in out.new_token_ids]
    chunks = list(sender.export_kv(rid, 0, len(prompt), 256, codec))
    receiver = Engine(loaded, block_size=DEFAULT_BLOCK_SIZE, num_blocks=blocks)
    receiver.attach_request(prompt, params, "md")
    for chunk in chunks:
        receiver.import_kv("md", chunk, codec)
    receiver.resume("md", [first])
    return [first, *(t for out in _drain(receiver) for t in out.new_token_ids)]


def _forced_logits(
    loaded: LoadedModel, prompt: Sequence[int], continuation: Sequence[int], codec: KVCodec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits ``[len(continuation), vocab]`` predicting each continuation token
    from the same history, over the exact and over the ``codec``-coded prompt KV."""
    n = len(prompt)
    layout = loaded.kv_layout(DEFAULT_BLOCK_SIZE)
    kv = PagedKVCache(layout, -(-(n + len(continuation)) // DEFAULT_BLOCK_SIZE), loaded.device)
    table = list(range(kv.num_blocks))

    def forward(seq: SeqInput) -> torch.Tensor:
        return loaded.model(
            ForwardBatch.build([seq], DEFAULT_BLOCK_SIZE, loaded.device), kv
        ).float()

    forward(SeqInput(list(prompt[:-1]), 0, table))
    history = [*prompt[-1:], *continuation[:-1]]
    exact = forward(SeqInput(history, n - 1, table, all_logits=True))
    prefix = kv.read_tokens(table, 0, n - 1)
    shape, dtype = tuple(prefix.shape), layout.dtype
    kv.write_tokens(table, 0, decode(encode(prefix, codec), codec, shape, dtype, loaded.device))
    return exact, forward(SeqInput(history, n - 1, table, all_logits=True))


def _drain(engine: Engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs
