"""What tracing costs the router per request, in CPU time on its event loop.

    python bench/tracing_overhead.py [--requests 20000] [--tokens 64] [--json OUT]

Runs the router's tracing hooks for one request (``pdd.request``, ``pdd.admission``,
``pdd.route`` with its attributes, the plan's ``trace_context`` and its copy, the
trace id looked up once, an ITL observation per output token, the first with the
exemplar)
``--requests`` times in this process, with tracing off, then on at ratio 1.0 (the batch
processor and ``pdd up``'s file exporter, the export on the SDK's thread as in
production), and prints the CPU microseconds per request, best of five rounds: on the
calling thread (the router's event loop) and in the whole process (the export too).
A stack's end-to-end figures on a busy machine bury a difference of this size in noise;
this is the part tracing adds to the path.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram

from pdd.common import tracing
from pdd.common.wire import Endpoint, PipelinePlan

ROUNDS = 5


def one_request(plan: PipelinePlan, tokens: int, itl: Histogram) -> None:
    """The hooks a request runs through, in the router's order."""
    with tracing.span("pdd.request", {"traceparent": ""}, {"url.path": "/v1/completions"}):
        with tracing.span("pdd.admission"):
            pass
        with tracing.span("pdd.route", attributes={tracing.REQUEST_ID: plan.request_id}):
            tracing.set_attributes({"pdd.pipeline": "P-RLD-MD", "pdd.kv_bytes": 123456})
        if tracing.enabled():
            plan = plan.model_copy(update={"trace_context": tracing.carrier()})
        trace_id = tracing.trace_id_hex()  # once per request (``Generation._exemplar``)
        exemplar = None if trace_id is None else {"trace_id": trace_id}
        for _ in range(tokens):  # the first gap carries the exemplar (``Generation``)
            itl.observe(0.01, exemplar)
            exemplar = None


def per_request_us(requests: int, tokens: int) -> tuple[float, float]:
    """Best of ``ROUNDS``: (this thread's CPU, the process's: the export thread's too)."""
    ends = {
        role: Endpoint(instance_id=role, http_url="http://x", fast_addr="x:1", wan_addr="x:2")
        for role in ("prefill", "relay", "main")
    }
    plan = PipelinePlan(request_id="pdd-bench", prompt_ids=list(range(512)), **ends)
    itl = Histogram("itl_seconds", "ITL", registry=CollectorRegistry())
    best_thread = best_process = float("inf")
    for _ in range(ROUNDS):
        thread, process = time.thread_time(), time.process_time()
        for _ in range(requests):
            one_request(plan, tokens, itl)
        tracing.flush()  # the export of this round's spans counts in the process's time
        best_thread = min(best_thread, time.thread_time() - thread)
        best_process = min(best_process, time.process_time() - process)
    return best_thread / requests * 1e6, best_process / requests * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--tokens", type=int, default=64, help="output tokens (exemplar lookups)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    off, off_all = per_request_us(args.requests, args.tokens)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "traces.jsonl"
        tracing.configure(tracing.config_from("pdd-router", file=path, env={}))
        on, on_all = per_request_us(args.requests, args.tokens)
        tracing.shutdown()
    result = {
        "loop_off_us": round(off, 2), "loop_on_us": round(on, 2),
        "process_off_us": round(off_all, 2), "process_on_us": round(on_all, 2),
        "dropped_spans": tracing.dropped_spans(),
    }  # fmt: skip
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
