"""What a vLLM instance cannot carry across a handoff: one rule for the worker and the router.

After a handoff (P's first token, a relay's tokens, or a router's resume after a failure)
the next instance submits the earlier output to vLLM as part of its prompt. vLLM carries
penalties and ``min_tokens`` across that exactly (``pdd.worker.vllm.sampling``), but not a
seeded sampler's state: vLLM seeds each request's generator afresh, so the resumed draws
are not those of one unbroken vLLM request. The worker refuses a handoff of such a
request, and the router sends it where one vLLM instance samples every token (P-MD with
MD computing its miss), so a user's seed means what it means on vLLM alone. (A resume
after a worker failed mid-answer goes on with a derived seed: ``pdd.worker.vllm.sampling``.)
"""

from __future__ import annotations

from pdd.common.wire import SamplingSpec


def vllm_resume_refusal(sampling: SamplingSpec) -> str | None:
    """Why vLLM cannot resume a request sampled so after a handoff; None where it can."""
    if sampling.seed is not None and sampling.temperature > 0 and sampling.top_k != 1:
        return "a seeded request at temperature > 0 (vLLM seeds a resumed request afresh)"
    return None
