"""A request's life in a simulated system, one simpy process per request.

The steps mirror the live data plane (docs/dataplane.md):

1. the router decides (``Cluster.route``, the router's own policy); a ``Saturated``
   answer is a 429 the client retries after ``Retry-After``;
2. P prefills its miss and caches the prompt, streaming MD's miss as it writes it:
   all but the last prefill chunk's KV crosses while P computes (from the end of the
   request's first step), the last chunk's once the prefill ends (``_stream_kv``);
3. **P-MD**: MD's miss crosses to MD (WAN, or RDMA in the same-datacenter baseline);
   MD streams the first token when the sequence joins its batch; where the router has
   MD compute its miss (sooner than its crossing), P computes nothing and MD prefills
   the miss itself (``_md_prefills``);
4. **P-RLD-MD**: the whole KV goes to RLD over RDMA while MD's miss crosses the WAN;
   RLD streams at once; when MD has its KV the relay hands over token IDs (one-shot,
   or catch-up chunks, by relay load: ``pdd.common.handoff``) and MD recomputes them
   in an extend before it continues; a relay that finishes first just finishes;
5. **P-RLD** (anomalous traffic): RLD runs it to completion, nothing crosses the WAN;
6. MD keeps the prompt in its decode-side radix cache (DRC) for the next turn, from
   the moment its KV has landed.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass

import simpy

from pdd.common.handoff import choose_handoff_mode
from pdd.common.kv_codec import default_codec, parse_kv_codec, shared_in_receiver_cache
from pdd.common.link_estimator import Transfer
from pdd.common.vocabulary import Pipeline
from pdd.router.policy import Decision
from pdd.simulator.cluster import Cluster, SimRequest
from pdd.simulator.decode import DecodeInstance, DecodeSeq
from pdd.simulator.links import SharedLink
from pdd.simulator.prefill import PrefillInstance, PrefillJob

#: A TOKEN_IDS handoff frame: a 4-byte id per token after an 8-byte (start, count) header
#: (``pdd.worker.transport.payloads.encode_token_ids``; a test checks they agree).
HANDOFF_HEADER_BYTES = 8
HANDOFF_BYTES_PER_TOKEN = 4


def handoff_bytes(tokens: int) -> int:
    return HANDOFF_HEADER_BYTES + HANDOFF_BYTES_PER_TOKEN * tokens


@dataclass
class RequestRecord:
    key: str
    arrival: float
    input_tokens: int
    output_tokens: int
    pipeline: str = ""
    reason: str = ""
    retries: int = 0
    lost: bool = False  # refused more than max_retries times
    kv_codec: str = ""  # the codec the router chose for MD's KV (adaptive), "" none chosen
    md_computes_miss: bool = False  # MD computed its miss (adaptive): no KV crossed
    wan_kv_bytes_per_token: int = 0  # MD's KV on the WAN per token, as coded
    p_hit_tokens: int = 0
    md_hit_tokens: int = 0
    first_token: float = math.nan
    finish: float = math.nan
    rld_tokens: int = 0  # output tokens the client got from a relay
    wan_bytes: float = 0.0
    handoff: str = ""  # one-shot | catch-up | "" (none)
    handoff_gap_s: float = 0.0  # the stream's pause at the final handoff

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish - self.first_token) / (self.output_tokens - 1)


Proc = Generator[simpy.Event, object, None]


def serve(c: Cluster, req: SimRequest, rec: RequestRecord) -> Proc:
    decision = yield from _admit(c, req, rec)
    if decision is None:
        return
    decision = c.apply_ablation(req, decision)
    pipeline = decision.pipeline
    c.traffic.record(pipeline == Pipeline.P_RLD, req.input_tokens)
    rec.pipeline, rec.reason = pipeline.value, decision.reason
    rec.kv_codec = decision.estimate.kv_codec or ""
    chosen_bpt = decision.estimate.kv_bytes_per_token
    rec.wan_kv_bytes_per_token = (  # the same-datacenter baseline's KV is never coded
        (c.wan_kv_bytes_per_token if chosen_bpt is None else chosen_bpt)
        if c.wan is not None
        else c.kv_bytes_per_token
    )
    rec.md_computes_miss = decision.estimate.md_computes_miss
    p = c.prefill_named(decision.instances.prefill)
    n = req.input_tokens
    rec.p_hit_tokens = min(decision.estimate.p_hit_tokens, n - 1)
    md = c.decoder_named(decision.instances.main_decode)
    rld = c.decoder_named(decision.instances.relay)
    rec.md_hit_tokens = (
        decision.estimate.md_hit_tokens if md is not None and md.cache is not None else 0
    )
    # The router counts a dispatched request at once; on MD as pending while P serves it
    # first (``Route.main_waits_upstream``: all but P-MD where MD computes its miss).
    md_prefills = pipeline == Pipeline.P_MD and rec.md_computes_miss
    if md is not None:
        md.reserve(pending=not md_prefills)
    if rld is not None:
        rld.reserve()
    transfer = _commit(c, req, rec, pipeline)
    if pipeline == Pipeline.P_MD and rec.md_computes_miss:  # MD prefills, P computes nothing
        assert md is not None, "the router's P-MD names an MD"
        yield c.env.process(_md_prefills(c, rec, n - rec.md_hit_tokens, md))
        yield from _decode_on_main(c, req, rec, md)
        return
    job = p.enqueue(n - rec.p_hit_tokens, rec.p_hit_tokens)
    if pipeline == Pipeline.P_RLD:
        assert rld is not None, "the router's P-RLD names a relay"
        yield from _prefill_on_p(req, p, job)
        yield from _relay_only(c, req, rec, rld)
        return
    assert md is not None, f"the router's {pipeline.value} names an MD"
    miss = n - rec.md_hit_tokens
    if rec.md_computes_miss:
        kv_at_md = c.env.process(_md_computes(c, rec, miss, job, md))
    else:
        chunk = p.max_num_batched_tokens
        kv_at_md = c.env.process(_stream_kv(c, rec, miss, chunk, job, transfer))
    yield from _prefill_on_p(req, p, job)
    # Past P: MD counts it in full. The router does at the first token, a relay step (or,
    # on P-MD, the KV's crossing) later; the simulator errs toward counting MD sooner.
    md.reached()
    if pipeline == Pipeline.P_MD:
        yield kv_at_md
        yield from _decode_on_main(c, req, rec, md)
    else:
        assert rld is not None, "the router's P-RLD-MD names a relay"
        yield from _relay_then_hand_off(c, req, rec, rld, md, kv_at_md)


def _prefill_on_p(req: SimRequest, p: PrefillInstance, job: PrefillJob) -> Proc:
    """P's prefill of the request ends; its radix cache then holds the prompt."""
    yield job.done
    if p.cache is not None:
        p.cache.insert(req.keys)


def _commit(c: Cluster, req: SimRequest, rec: RequestRecord, pipeline: Pipeline) -> Transfer | None:
    """The router commits MD's miss to the WAN line at dispatch, as the live one does."""
    if c.wan is None or pipeline == Pipeline.P_RLD or rec.md_computes_miss:
        return None  # nothing crosses, or nothing but the first token
    nbytes = (req.input_tokens - rec.md_hit_tokens) * rec.wan_kv_bytes_per_token
    prefill_tokens = req.input_tokens - rec.p_hit_tokens
    return c.link_estimator.commit(nbytes, "", prefill_tokens, c.env.now)


def _admit(
    c: Cluster, req: SimRequest, rec: RequestRecord
) -> Generator[simpy.Event, object, Decision | None]:
    for _ in range(c.scenario.router.max_retries + 1):
        decision = c.route(req)
        if isinstance(decision, Decision):
            return decision
        rec.retries += 1
        yield c.env.timeout(decision.retry_after_s)
    rec.lost = True
    return None


def _send_kv(c: Cluster, rec: RequestRecord, tokens: int, transfer: Transfer | None) -> simpy.Event:
    """MD's miss over the KV path; a committed transfer leaves the backlog as it lands."""
    nbytes = tokens * rec.wan_kv_bytes_per_token
    if c.wan is not None:
        rec.wan_bytes += nbytes
    landed = c.kv_link.transfer(nbytes)
    if transfer is not None:
        landed.callbacks.append(lambda _: c.link_estimator.settle(transfer))
    return landed


def _stream_kv(
    c: Cluster, rec: RequestRecord, tokens: int, chunk_tokens: int, job: PrefillJob,
    transfer: Transfer | None,
) -> Proc:  # fmt: skip
    """MD's miss streamed as P writes it (``PrefillRole``): all but the last prefill
    chunk's KV goes on the line once P's first step for the request ends, never landing
    before the prefill could have written it; the last chunk's follows the prefill."""
    tail = min(tokens, chunk_tokens)
    if tokens > tail:
        yield job.written
        yield _send_kv(c, rec, tokens - tail, None)
    yield job.done
    yield _send_kv(c, rec, tail, transfer)


def _md_computes(
    c: Cluster, rec: RequestRecord, tokens: int, job: PrefillJob, md: DecodeInstance
) -> Proc:
    """MD computes its miss (``PipelinePlan.md_computes_miss``): P's first token crosses
    once P's prefill is done, then MD prefills ``tokens`` on its own hardware (its
    batch's steps are not charged for it: a bound on what the choice costs MD)."""
    yield job.done
    yield _send_kv(c, rec, 0, None)
    yield c.env.timeout(md.shape.prefill_seconds(tokens, rec.md_hit_tokens))


def _md_prefills(c: Cluster, rec: RequestRecord, tokens: int, md: DecodeInstance) -> Proc:
    """MD prefills (``PipelinePlan.md_prefills``): the request crosses to MD (nothing but
    its IDs), then MD prefills ``tokens`` on its own hardware (its batch's steps are not
    charged for it, as in ``_md_computes``); the first token is MD's own."""
    yield _send_kv(c, rec, 0, None)
    yield c.env.timeout(md.shape.prefill_seconds(tokens, rec.md_hit_tokens))


def _relay_only(c: Cluster, req: SimRequest, rec: RequestRecord, rld: DecodeInstance) -> Proc:
    yield c.in_dc.transfer(req.input_tokens * c.kv_bytes_per_token)
    yield from _decode_whole(c, req, rec, rld)
    rec.rld_tokens = req.output_tokens


def _relay_then_hand_off(
    c: Cluster,
    req: SimRequest,
    rec: RequestRecord,
    rld: DecodeInstance,
    md: DecodeInstance,
    kv_at_md: simpy.Event,
) -> Proc:
    n, out = req.input_tokens, req.output_tokens
    yield c.in_dc.transfer(n * c.kv_bytes_per_token)
    rseq = rld.submit(n, out - 1, reserved=True)
    yield rseq.started | kv_at_md
    if not rseq.started.triggered:  # MD has the KV before the relay got a slot: no relay
        rld.stop(rseq, hold=False)
        yield from _decode_on_main(c, req, rec, md)
        return
    rec.first_token = c.env.now
    yield rseq.done | kv_at_md
    if rseq.done.triggered:  # the relay finished first; MD still keeps the prompt's KV
        rec.finish, rec.rld_tokens = rseq.finished_at, out
        yield kv_at_md
        md.unreserve()
        _remember(c, rec, md, req)
        return
    _remember(c, rec, md, req)
    yield from _hand_off(c, req, rec, rld, md, rseq)


def _decode_on_main(c: Cluster, req: SimRequest, rec: RequestRecord, md: DecodeInstance) -> Proc:
    _remember(c, rec, md, req)
    yield from _decode_whole(c, req, rec, md)


def _decode_whole(c: Cluster, req: SimRequest, rec: RequestRecord, inst: DecodeInstance) -> Proc:
    """The whole answer from one decode instance, which streams P's first token as soon
    as it admits the request."""
    seq = inst.submit(req.input_tokens, req.output_tokens - 1, reserved=True)
    yield seq.started
    rec.first_token = c.env.now
    yield seq.done
    rec.finish = c.env.now


def _hand_off(
    c: Cluster,
    req: SimRequest,
    rec: RequestRecord,
    rld: DecodeInstance,
    md: DecodeInstance,
    rseq: DecodeSeq,
) -> Proc:
    h, wan = c.scenario.handoff, c.wan
    assert wan is not None, "a relay hands off to MD across the WAN"
    rec.handoff = choose_handoff_mode(h.mode, "auto", rld.utilization, h.catchup_load_level)
    handed = 0
    while rec.handoff == "catch-up" and not rseq.done.triggered:
        chunk = rld.generated(rseq) - handed
        if chunk <= h.catchup_threshold:
            break
        yield _send_ids(wan, rec, chunk)
        yield md.extend(chunk, req.input_tokens + handed)
        handed += chunk
    if rseq.done.triggered:  # the relay finished during catch-up
        rec.finish, rec.rld_tokens = rseq.finished_at, req.output_tokens
        md.unreserve()
        return
    generated = rld.stop(rseq, hold=True)
    stopped_at = c.env.now
    rec.rld_tokens = 1 + generated  # the first token, then what the relay decoded
    yield _send_ids(wan, rec, generated - handed)
    c.env.timeout(wan.rtt_s / 2).callbacks.append(lambda _: rld.release())  # MD's ack
    left = req.output_tokens - 1 - generated
    seq = md.submit(req.input_tokens + generated, left, extend=generated - handed, reserved=True)
    yield seq.started
    rec.handoff_gap_s = max(c.env.now, md.paused_until) - stopped_at
    yield seq.done
    rec.finish = c.env.now


def _send_ids(wan: SharedLink, rec: RequestRecord, tokens: int) -> simpy.Event:
    nbytes = handoff_bytes(tokens)
    rec.wan_bytes += nbytes
    return wan.transfer(nbytes)


def _remember(c: Cluster, rec: RequestRecord, md: DecodeInstance, req: SimRequest) -> None:
    """DRC: once MD holds the prompt's KV, its radix cache serves the next turn from it
    (inserting again on a later path only refreshes recency); KV that crossed coded
    under adaptive is not kept (``shared_in_receiver_cache``), as on a real MD."""
    setting = c.scenario.wan.kv_codec
    codec = parse_kv_codec(rec.kv_codec) if rec.kv_codec else default_codec(setting)
    if md.cache is not None and shared_in_receiver_cache(codec, setting):
        md.cache.insert(req.keys)
