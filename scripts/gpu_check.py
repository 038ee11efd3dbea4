"""The GPU check's steps (scripts/gpu-check.sh runs this with the GPU environment's python).

For each engine (vLLM first): ``pdd up --mode pdd`` on one machine (P, RLD and MD as
processes sharing the GPU), the same greedy chat prompts through it, then a short ``pdd
bench`` of that engine; then greedy parity between the engines' answers, and one JSON of
everything measured. Each step has its share of a deadline, so the whole check ends in
time (``--budget-s``) and says which step ran out.

    python scripts/gpu_check.py --out gpu-check.json [--engines vllm,pdd] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

MODEL = "smollm2-135m-instruct"
#: Greedy chat prompts whose answers both engines give (float32 on both sides).
PROMPTS = (
    "What is the capital of France?",
    "Name three prime numbers and say why each is prime.",
    "Explain in two sentences what a hash map is.",
    "Write a haiku about the sea.",
)
MAX_TOKENS = 32
#: Every worker's flags, either engine: float32 for parity, and a quarter of the GPU's
#: memory each, as P, RLD and MD share it (the default, 0.9, is for one instance per GPU).
WORKER_ARGS = ("--worker-arg=--dtype=float32", "--worker-arg=--gpu-memory-utilization=0.25")
#: vLLM's start without compiling the model or capturing CUDA graphs: seconds, not minutes
#: (its outputs are the same; its steps slower, which the short bench shows as it is).
ENGINE_ARGS = {"vllm": ("--worker-arg=--enforce-eager",), "pdd": ()}


class StepTimeout(RuntimeError):
    """A step did not finish within its share of the check's budget."""


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    engines = args.engines.split(",")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"model": MODEL, "prompts": len(PROMPTS), "engines": {}}
    started = time.monotonic()
    for i, engine in enumerate(engines):
        report["engines"][engine] = run_engine(engine, args, deadline, len(engines) - i)
    report["parity"] = parity(report["engines"])
    report["wall_s"] = round(time.monotonic() - started, 1)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    failed = [e for e, r in report["engines"].items() if r.get("error")]
    print(f"gpu-check: wrote {args.out} ({report['wall_s']} s); "
          f"parity {report['parity']}; failed: {failed or 'none'}")  # fmt: skip
    unequal = report["parity"] is not None and not report["parity"]["all_equal"]
    return 1 if failed or unequal else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("gpu-check.json"))
    p.add_argument("--engines", default="vllm,pdd")
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--port", type=int, default=18480)
    p.add_argument("--log-dir", type=Path, default=Path("gpu-check-logs"))
    return p


def run_engine(engine: str, args: argparse.Namespace, deadline: float, left: int) -> dict:
    """One engine's stack, answers and bench; an error is recorded, not raised."""
    share = (deadline - time.monotonic()) / left
    result: dict[str, Any] = {}
    try:
        stack_until = time.monotonic() + share * 0.5
        result.update(serve_and_ask(engine, args, stack_until))
        result["bench"] = bench(engine, args, deadline - (left - 1) * share)
    except (StepTimeout, OSError, httpx.HTTPError, subprocess.SubprocessError, KeyError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def serve_and_ask(engine: str, args: argparse.Namespace, until: float) -> dict:
    """``pdd up --engine ENGINE``, the prompts at temperature 0 through it, then stop."""
    log_dir = args.log_dir / f"up-{engine}"
    command = [sys.executable, "-m", "pdd.cli", "up", "--engine", engine, "--mode", "pdd",
               "--model", MODEL, "--port", str(args.port), "--log-dir", str(log_dir),
               *WORKER_ARGS, *ENGINE_ARGS[engine]]  # fmt: skip
    began = time.monotonic()
    up = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        base_url = wait_for_base_url(up, until)
        ready_s = time.monotonic() - began
        answers = [ask(base_url, prompt, until) for prompt in PROMPTS]
    finally:
        stop(up)
    return {"ready_s": round(ready_s, 1), "answers": answers}


def wait_for_base_url(up: subprocess.Popen[str], until: float) -> str:
    """The base URL ``pdd up`` prints once every process is ready (its output is read on
    a thread, which ends with it, so that the deadline holds while it prints nothing)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in up.stdout or ()], daemon=True
    ).start()
    while True:
        try:
            line = lines.get(timeout=min(left_s(until), 1.0))
        except queue.Empty:
            if up.poll() is not None:
                raise StepTimeout(f"pdd up exited {up.returncode} before it was ready") from None
            continue
        if "OpenAI base URL: " in line:
            return line.split("OpenAI base URL: ", 1)[1].strip()


def ask(base_url: str, prompt: str, until: float) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    reply = httpx.post(f"{base_url}/chat/completions", json=body, timeout=left_s(until))
    reply.raise_for_status()
    return {
        "prompt": prompt,
        "text": reply.json()["choices"][0]["message"]["content"],
        "pipeline": reply.headers.get("x-pdd-pipeline"),
    }


def bench(engine: str, args: argparse.Namespace, until: float) -> dict:
    """A short ``pdd bench`` of the engine (mode pdd, the sample's first 16 requests); its
    summary as the bench wrote it."""
    out_dir = args.log_dir / f"bench-{engine}"
    command = [sys.executable, "-m", "pdd.cli", "bench", "--engine", engine,
               "--modes", "pdd", "--max-requests", "16", "--model", MODEL,
               "--out-dir", str(out_dir), "--no-plots", "--no-progress",
               *WORKER_ARGS, *ENGINE_ARGS[engine]]  # fmt: skip
    began = time.monotonic()
    with (args.log_dir / f"bench-{engine}.log").open("w") as log:
        # Its own session: the bench starts stacks, which a stop must take down with it.
        run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
        try:
            run.wait(left_s(until))
        finally:
            stop(run)
    summary: dict[str, Any] = {"exit": run.returncode, "wall_s": round(time.monotonic() - began)}
    results = out_dir / "results.json"
    if results.exists():
        summary["results"] = json.loads(results.read_text())
    return summary


def parity(engines: dict[str, dict]) -> dict | None:
    """How many prompts every engine answered as the first did, greedily; None where
    fewer than two engines answered."""
    answered = {e: [a["text"] for a in r["answers"]] for e, r in engines.items() if "answers" in r}
    if len(answered) < 2:
        return None
    first, *others = answered.values()
    equal = sum(all(o[i] == first[i] for o in others) for i in range(len(first)))
    return {"compared": sorted(answered), "equal": equal, "of": len(first),
            "all_equal": equal == len(first)}  # fmt: skip


def left_s(until: float) -> float:
    left = until - time.monotonic()
    if left <= 0:
        raise StepTimeout("out of the check's budget")
    return left


def stop(up: subprocess.Popen[Any]) -> None:
    """Ctrl-C to its process group, as a person stops ``pdd up`` or ``pdd bench`` (each
    stops every process it started); SIGKILL to the group a minute later."""
    if up.poll() is None:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
