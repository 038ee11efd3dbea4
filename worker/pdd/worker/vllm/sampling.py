"""The pdd engine's sampling parameters as vLLM's: one mapping, so ``pdd generate --engine
vllm`` and the vLLM worker sample alike, each request checked by the pdd engine's rules
first (``pdd.worker.engine.sampling.SamplingParams``, built by the roles'
``sampling_params``) and then given to vLLM under vLLM's names.

A resumed request (``prior_output_tokens``: after a handoff, or the router's resume) has
its earlier output at the end of the prompt vLLM gets, and vLLM counts only the output it
samples itself. What depends on the output history is carried exactly, by vLLM's own
code (vllm 0.32's ``v1/sample``):

- ``min_tokens`` less the earlier output: vLLM's ``MinTokensLogitsProcessor`` masks the
  stop tokens while its own output is shorter than that, so while the whole output is
  shorter than ``min_tokens``. At most ``max_tokens`` (vLLM refuses more): P, which
  samples one token of a request whose ``min_tokens`` is larger, masks that one.
- The penalties go to ``PriorOutputPenalties`` (``prior_penalties.py``, a custom logits
  processor), which calls vLLM's ``apply_all_penalties`` on the request's row with the
  original prompt and the whole output (earlier + vLLM's own); vLLM's own penalties for
  that request are made neutral. vLLM runs custom processors after ``min_tokens`` and
  logit bias and before its penalties, so the row goes through the same operations, in
  the same order, on the same inputs as in one unbroken vLLM request. (Passing the
  repetition penalty to vLLM alone would be exact too, since it covers prompt and output
  alike; presence and frequency over the earlier output would not.)

A seeded draw at temperature > 0 is not carried: vLLM seeds each request's generator
afresh. A handoff of such a request is refused (``check_handoff``; the router sends those
where one instance samples every token, ``pdd.common.vllm_resume``). A router's resume
after a failure (the request's earlier output sent, the instance that sampled it gone)
goes on with a seed derived from the request's and the number of tokens sent
(``resumed_seed``): reproducible run to run, but not the draws an unbroken vLLM request
would have made, where the pdd engine's are. Finishing the answer is worth more to the
client than an error after its first tokens, and there is no unbroken run to match.

What else vLLM cannot do as the pdd engine does is refused with a reason
(``VllmSamplingError``, a ``ValueError``: the control API answers 400), never silently
changed: a grammar (``guided``) and logprobs.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pdd.common.vllm_resume import vllm_resume_refusal
from pdd.worker.engine.sampling import SamplingParams

#: The key in vLLM's ``SamplingParams.extra_args`` under which ``PriorOutputPenalties``
#: finds a resumed request's penalties (``prior_penalties_args``).
PRIOR_PENALTIES_KEY = "pdd_prior_output_penalties"


class VllmSamplingError(ValueError):
    """The request asks for sampling the vLLM engine does not (yet) do; says what."""


def check_supported(params: SamplingParams) -> None:
    """Raise ``VllmSamplingError`` for what the vLLM worker cannot sample as asked."""
    if params.guided is not None:
        raise VllmSamplingError("structured output (a grammar) is not yet served by engine vllm")
    if params.logprobs is not None:
        raise VllmSamplingError("logprobs are not yet served by engine vllm")


def check_handoff(params: SamplingParams) -> None:
    """``check_supported``, and refuse a request another instance would go on sampling
    after this one (P's first token, a relay's tokens) where vLLM cannot carry the draws:
    before anything runs, not at the handoff."""
    check_supported(params)
    refusal = vllm_resume_refusal(params)
    if refusal is not None:
        raise VllmSamplingError(f"a handoff is not served by engine vllm for {refusal}")


def resumed_seed(params: SamplingParams) -> int | None:
    """The seed vLLM gets: the request's, or, for a seeded request at temperature > 0 that
    a router resumes after ``prior_output_tokens`` (its first sampler gone), one derived
    from it and that count (63 bits, as torch's generators take), so the rest of the
    answer is drawn afresh but the same in every run."""
    if params.seed is None or not params.prior_output_tokens or not vllm_resume_refusal(params):
        return params.seed
    digest = hashlib.sha256(f"{params.seed}:{params.prior_output_tokens}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def prior_penalties_args(params: SamplingParams) -> dict[str, Any] | None:
    """What ``PriorOutputPenalties`` needs for a resumed, penalized request (the earlier
    output's length and the three penalties); None where vLLM's own penalties are exact
    (no earlier output, or no penalty)."""
    if not (params.prior_output_tokens and params.penalized):
        return None
    return {
        "prior_output_tokens": params.prior_output_tokens,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
    }


def vllm_sampling_kwargs(
    params: SamplingParams, kv_transfer_params: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for ``params`` (checked first): token
    IDs only (no detokenizing), the connector's move and a resumed request's penalties
    in ``extra_args`` where given."""
    check_supported(params)
    prior_penalties = prior_penalties_args(params)
    extra: dict[str, Any] = {}
    if kv_transfer_params:
        extra["kv_transfer_params"] = kv_transfer_params
    if prior_penalties is not None:  # applied by PriorOutputPenalties, not by vLLM
        extra[PRIOR_PENALTIES_KEY] = prior_penalties
    own = prior_penalties is None
    return {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "seed": resumed_seed(params),
        "ignore_eos": params.ignore_eos,
        "stop_token_ids": list(params.stop_token_ids),
        "presence_penalty": params.presence_penalty if own else 0.0,
        "frequency_penalty": params.frequency_penalty if own else 0.0,
        "repetition_penalty": params.repetition_penalty if own else 1.0,
        "min_tokens": _min_tokens(params),
        "logit_bias": dict(params.logit_bias) or None,
        "detokenize": False,
        "extra_args": extra or None,
    }


def _min_tokens(params: SamplingParams) -> int:
    """``min_tokens`` as vLLM counts it: less the earlier output, at most ``max_tokens``
    (the mask holds for every token this request samples either way)."""
    return min(params.max_tokens, max(0, params.min_tokens - params.prior_output_tokens))
