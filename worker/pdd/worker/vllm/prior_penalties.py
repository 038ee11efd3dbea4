"""A vLLM logits processor that penalizes a resumed request over its whole output.

After a handoff, vLLM gets the earlier output at the end of the prompt and counts only
what it samples itself as output, so its presence and frequency penalties would miss the
earlier tokens. ``pdd.worker.vllm.sampling`` moves such a request's penalties into
``extra_args`` (``PRIOR_PENALTIES_KEY``) and makes vLLM's own neutral; this processor
applies them with vLLM's own ``apply_all_penalties`` to the request's row, over the
original prompt and the earlier output followed by vLLM's. vLLM runs custom processors
after ``min_tokens`` and logit bias and before its penalties, so the row is penalized as
one unbroken vLLM request's would be, bit for bit (vLLM's neutral penalties then multiply
by 1 and subtract 0).

Loaded by vLLM in its engine core from the engine's ``logits_processors``
(``engine_args.PRIOR_PENALTIES_PROCESSOR``); imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.utils.torch_utils import make_tensor_with_pad
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.ops.penalties import apply_all_penalties

from pdd.worker.vllm.sampling import PRIOR_PENALTIES_KEY

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class _Row:
    """One resumed request: its original prompt, its earlier output, vLLM's output (the
    list vLLM appends to) and its penalties."""

    prompt: list[int]
    prior: list[int]
    output: Sequence[int]
    presence: float
    frequency: float
    repetition: float

    def whole_output(self) -> list[int]:
        return [*self.prior, *self.output]


def _row_of(
    params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
) -> _Row | None:
    """The row of a request whose ``extra_args`` carry its penalties; None for others."""
    args: dict[str, Any] | None = (params.extra_args or {}).get(PRIOR_PENALTIES_KEY)
    if args is None:
        return None
    prior = int(args["prior_output_tokens"])
    if prompt_ids is None or not 0 < prior < len(prompt_ids):
        raise ValueError(f"{PRIOR_PENALTIES_KEY} needs a prompt of more than {prior} token IDs")
    return _Row(
        prompt_ids[:-prior], prompt_ids[-prior:], output_ids, float(args["presence_penalty"]),
        float(args["frequency_penalty"]), float(args["repetition_penalty"]),
    )  # fmt: skip


class PriorOutputPenalties(LogitsProcessor):
    """Presence, frequency and repetition penalties over a resumed request's whole output."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self._rows: dict[int, _Row] = {}  # batch index -> row

    def is_argmax_invariant(self) -> bool:
        """Penalties change which token is the most likely."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, _row_of)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        index = sorted(self._rows)
        rows = [self._rows[i] for i in index]
        vocab = logits.shape[1]
        prompts = make_tensor_with_pad([r.prompt for r in rows], pad=vocab, dtype=torch.int64)

        def penalty(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=logits.device)

        at = torch.tensor(index, dtype=torch.int64, device=logits.device)
        logits[at] = apply_all_penalties(
            logits[at], prompts.to(logits.device), penalty([r.presence for r in rows]),
            penalty([r.frequency for r in rows]), penalty([r.repetition for r in rows]),
            [r.whole_output() for r in rows],
        )  # fmt: skip
        return logits
