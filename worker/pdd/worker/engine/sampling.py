"""Per-request sampling whose random draw depends only on (request seed, position).

PDD hands a request from one instance to another mid-generation (relay decode
-> main decode). Both must produce the same token at the same position, or the
client sees a fork. So the randomness is not a stateful generator but a pure
function: the uniform number used for the token at position ``i`` (its index
in the whole sequence, prompt included, so the prompt/output split does not
matter) is ``uniform(seed, i)``, a 64-bit mix of the two. The token is then drawn by
inverse CDF over the filtered distribution, so any instance with the same
logits samples the same token, whatever else is in its batch.

Before the pick, ``process_logits`` steers the logits row (logit bias, the
``min_tokens`` mask, repetition/frequency/presence penalties) from the request's
own token history: ``prompt_ids`` and ``output_ids``, which on every role hold
the same tokens (a main decode holds the handed-over IDs as output), so the
steered row, and the token, are the same wherever the position is sampled.
Reported logprobs are those of the steered row before temperature and top-k/top-p
(see docs/engine.md). A request that asks for none of it takes the plain path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pdd.common.wire import SamplingSpec, TokenLogprobs, TopLogprob

_MASK64 = (1 << 64) - 1

#: A logprob of -inf (a masked token) is reported as this, as vLLM does: JSON has no -inf.
LOGPROB_FLOOR = -9999.0


class SamplingParams(SamplingSpec):
    """How to pick tokens and when to stop: the wire's ``SamplingSpec``, its fields, defaults
    and ranges, plus only what the engine derives from them. A field is declared once, on
    the spec; every role samples by the plan's own (``roles.base.sampling_params``).

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable
    those filters. ``seed=None`` lets the engine pick one at ``add_request`` time;
    pass an explicit seed whenever another instance may continue the request. Out-of-range
    values raise pydantic's ``ValidationError`` (a ``ValueError``) naming the field.
    """

    @classmethod
    def of(cls, spec: SamplingSpec, **changes: object) -> SamplingParams:
        """The engine's parameters for ``spec``, with ``changes`` (checked as a new one is)."""
        return cls.model_validate({**dict(spec), **changes})

    def with_changes(self, **changes: object) -> SamplingParams:
        """A copy with ``changes``, checked (``model_copy`` would take any value)."""
        return self.of(self, **changes)

    @property
    def penalized(self) -> bool:
        """Whether any penalty applies (they need the token history)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def steers(self) -> bool:
        """Whether ``process_logits`` may change this request's row at all."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        """True when the pick is the argmax: temperature 0, or a filter that keeps one token."""
        return self.temperature == 0 or self.top_k == 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """The random number in [0, 1) used at sequence ``position`` of a request with ``seed``."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 11) / float(1 << 53)


def _filtered_probs(
    logits: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature/top-k/top-p, with the token id of each entry.

    Without top-k/top-p the order is the vocabulary order (no sort needed); with
    them it is descending probability (stable, so ties keep vocabulary order).
    """
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_k == 0 and params.top_p >= 1:
        return probs, torch.arange(probs.numel(), device=probs.device)
    probs, ids = torch.sort(probs, descending=True, stable=True)
    keep = probs.numel()
    if params.top_k:
        keep = min(keep, params.top_k)
    if params.top_p < 1:
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep = min(keep, max(1, int((mass_before < params.top_p).sum().item())))
    return probs[:keep], ids[:keep]


class History(Protocol):
    """A request's tokens so far: the prompt, and the output (handed-over IDs included)."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def output_ids(self) -> list[int]: ...


def output_history(params: SamplingParams, history: History) -> list[int]:
    """The request's whole output so far: an earlier attempt's output, which a resumed
    request carries at the end of its prompt (``prior_output_tokens``), then this one's.
    What counts output tokens reads this, so a resume changes none of it."""
    prior = params.prior_output_tokens
    if not prior:
        return history.output_ids
    return history.prompt_ids[len(history.prompt_ids) - prior :] + history.output_ids


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """The logits rows ``[N, vocab]`` as the pick sees them: biased, masked, penalized.

    The order is vLLM's: logit bias and the ``min_tokens`` mask, then the repetition,
    frequency and presence penalties. Rows whose request asks for none of it are
    returned as they are; the result is a new fp32 tensor (the input is not changed).
    """
    out = logits.float().clone()
    _apply_logit_bias(out, params)
    _mask_until_min_tokens(out, params, histories, eos_token_ids)
    penalized = [row for row, p in enumerate(params) if p.penalized]
    if penalized:
        sub = [params[r] for r in penalized]
        out[penalized] = apply_penalties(out[penalized], sub, [histories[r] for r in penalized])
    return out


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return
    cols = [t for p in params for t, _ in p.logit_bias]
    bias = [b for p in params for _, b in p.logit_bias]
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    values = torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    logits.index_put_(index, values, accumulate=True)


def _mask_until_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History],
    eos_token_ids: Sequence[int],
) -> None:
    """Stop tokens cannot be picked before ``min_tokens`` are out (EOS unless ignored)."""
    for row, (p, h) in enumerate(zip(params, histories, strict=True)):
        if p.min_tokens and len(output_history(p, h)) < p.min_tokens:
            stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            if stops:
                logits[row, stops] = float("-inf")


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[History]
) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output) penalties, as
    tensor ops over the whole batch of rows (the token counts are built by scatter). A
    resumed request's earlier output is output here, not prompt (``output_history``)."""
    vocab = logits.shape[1]
    device = logits.device
    outputs = [output_history(p, h) for p, h in zip(params, histories, strict=True)]
    counts = _token_counts(outputs, vocab, device)
    rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    if bool((rep != 1).any()):
        seen = (counts > 0) | (_token_counts([h.prompt_ids for h in histories], vocab, device) > 0)
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, scaled, logits)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    return logits - freq * counts - pres * (counts > 0).float()


def _token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(seqs), vocab]`` fp32: how often each token occurs in each sequence."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), vocab, dtype=torch.long)  # pad: an extra column
    for row, seq in enumerate(seqs):
        if seq:
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Per row: the picked token's logprob and the ``params.logprobs`` most likely, from
    the (processed) logits before temperature and filters; None where none was asked."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    # A row whose steered logits overflowed has no distribution: its NaNs report as the
    # floor rather than as a number no JSON reader takes.
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1).nan_to_num(nan=LOGPROB_FLOOR)
    picked = torch.tensor([tokens[r] for r in rows], device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, picked).squeeze(1).tolist()
    k = max(params[r].logprobs or 0 for r in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    for i, row in enumerate(rows):
        n = params[row].logprobs or 0
        top = [
            TopLogprob(token_id=int(t), logprob=max(float(v), LOGPROB_FLOOR))
            for t, v in zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist(), strict=True)
        ]
        out[row] = TokenLogprobs(logprob=max(chosen[i], LOGPROB_FLOOR), top=tuple(top))
    return out


def sample_one(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """Pick the token for one request from its fp32 logits row ``[vocab]``."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs, ids = _filtered_probs(logits, params)
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = uniform(seed, position) * cdf[-1].item()
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype, device=cdf.device)))
    return int(ids[min(index, ids.numel() - 1)].item())


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[int]:
    """Pick one token per row of ``logits`` ``[N, vocab]``.

    Greedy rows share one batched argmax; sampled rows go one by one (each has
    its own filters), which keeps every row independent of its batch mates.
    """
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, p in enumerate(params):
        if not p.greedy:
            tokens[row] = sample_one(logits[row], p, seeds[row], positions[row])
    return tokens
