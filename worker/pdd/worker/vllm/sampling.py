"""The pdd engine's sampling parameters as vLLM's: one mapping, so ``pdd generate --engine
vllm`` and the vLLM worker sample alike, each request checked by the pdd engine's rules
first (``pdd.worker.engine.sampling.SamplingParams``, built by the roles'
``sampling_params``) and then given to vLLM under vLLM's names.

What vLLM cannot do as the pdd engine does is refused with a reason (``VllmSamplingError``,
a ``ValueError``: the control API answers 400), never silently changed: a grammar
(``guided``), logprobs, and a resumed request's earlier output (``prior_output_tokens``)
where penalties or ``min_tokens`` would count it (vLLM counts only its own output).
"""

from __future__ import annotations

from typing import Any

from pdd.worker.engine.sampling import SamplingParams


class VllmSamplingError(ValueError):
    """The request asks for sampling the vLLM engine does not (yet) do; says what."""


def check_supported(params: SamplingParams) -> None:
    """Raise ``VllmSamplingError`` for what the vLLM worker cannot sample as asked."""
    if params.guided is not None:
        raise VllmSamplingError("structured output (a grammar) is not yet served by engine vllm")
    if params.logprobs is not None:
        raise VllmSamplingError("logprobs are not yet served by engine vllm")
    if params.prior_output_tokens and _uses_output_history(params):
        raise VllmSamplingError(
            "a resumed request (prior_output_tokens) with penalties or min_tokens is not "
            "served by engine vllm: vLLM counts only the output it sampled itself"
        )


def _uses_output_history(params: SamplingParams) -> bool:
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.min_tokens
    )


def vllm_sampling_kwargs(
    params: SamplingParams, kv_transfer_params: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for ``params`` (checked first): token
    IDs only (no detokenizing), the connector's move in ``extra_args`` where given."""
    check_supported(params)
    return {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "seed": params.seed,
        "ignore_eos": params.ignore_eos,
        "stop_token_ids": list(params.stop_token_ids),
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "min_tokens": params.min_tokens,
        "logit_bias": dict(params.logit_bias) or None,
        "detokenize": False,
        "extra_args": {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    }
