"""A main decode that dies after the handoff, mid-stream: the router resumes the request.

Real processes: P, RLD, two healthy MDs, and ``a-victim``, an MD whose HTTP API (its
token stream to the router) sits behind a WAN link emulator the test holds, and whose
KV port sits behind a second one. The order is forced, never timed:

1. the victim's KV line is held to a trickle, so it cannot take the request over yet;
2. the request starts (P-RLD-MD, one-shot handoff); once the router's stream request
   has crossed the victim's HTTP line, the line is cut: nothing the victim says reaches
   the router;
3. the client reads its first tokens (from the relay); the KV line is restored, the
   relay hands the request to the victim (the relay's handoff counter says so);
4. the victim is killed and its line healed: the router's stream to it breaks after
   the tokens the relay sent, and the router resumes on a healthy MD from the prompt
   plus those tokens.

The client's text must equal mono's (``pdd generate``), with one ``resume`` counted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from pdd.local.cluster import (
    LinkSpec,
    LocalCluster,
    WanLinkProc,
    WorkerSpec,
    free_port,
    http_ok,
)
from pdd.local.supervisor import spawn_pdd
from pdd.testing.waiting import until_sync

from .test_redispatch import COMMON, VICTIM, metrics, prompt_whose_conversation_lands_on

pytestmark = pytest.mark.integration

MAX_TOKENS = 200  # the relay cannot finish this before a KV transfer of 70 tokens lands
TRICKLE_GBPS = 1e-5
HANDOFF = 'pdd_worker_handoffs_total{mode="one-shot"}'


@pytest.fixture
def victim(tmp_path):
    """The victim MD, and the emulated line in front of its HTTP API (held by the test)."""
    http_line = free_port()
    spec = WorkerSpec(
        VICTIM, "main", wan_facing=True, args=("--advertise-http", f"127.0.0.1:{http_line}")
    )
    c = LocalCluster.start([spec], tmp_path, LinkSpec(gbps=10.0), common_args=COMMON)
    admin, log = free_port(), tmp_path / "http-line.log"
    argv = [
        "wan-link", "--listen", f"127.0.0.1:{http_line}", "--to", c[VICTIM].url.removeprefix("http://"),
        "--link-gbps", "1", "--admin", f"127.0.0.1:{admin}", "--partition-grace-s", "3600",
    ]  # fmt: skip
    line = WanLinkProc(spawn_pdd(argv, log, {}), f"http://127.0.0.1:{admin}", log)
    until_sync(lambda: http_ok(f"{line.admin_url}/stats"), "the HTTP line's admin endpoint")
    yield c[VICTIM], line, f"http://127.0.0.1:{http_line}"
    line.proc.kill()
    line.proc.wait()
    c.stop()


def mono_text(prompt: list[int]) -> str:
    argv = ["generate", "--model", "tiny", "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]
    argv += ["--json", "--prompt-ids", ",".join(map(str, prompt))]
    out = subprocess.run([sys.executable, "-m", "pdd.cli", *argv], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ids = json.loads(out.stdout)["token_ids"]
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def resumes(url: str) -> float:
    line = [ln for ln in metrics(url).splitlines() if 'kind="resume"' in ln]
    return float(line[0].rsplit(" ", 1)[1]) if line else 0.0


def test_md_dead_after_the_handoff_is_resumed_from_the_tokens_sent(
    victim, cluster, worker_flags, start_router
) -> None:
    md, http_line, line_url = victim
    flags = [*worker_flags(), "--main", f"{VICTIM}={line_url}", "--poll-interval-s", "3600"]
    router = start_router(*flags, "--ttft-budget-s", "0.0001", "--handoff", "one-shot")
    prompt = prompt_whose_conversation_lands_on(VICTIM, ("md1", "md2"), stride=59)
    relay = cluster["rld"]
    handoffs_before = relay.metrics().get(HANDOFF, 0.0)
    assert md.link is not None
    md.link.set_rate(TRICKLE_GBPS)  # 1. the victim cannot get the KV yet
    polled = http_line.stats()["forward"]["bytes"]  # the router's one poll, and no more

    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    text = []
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        until_sync(  # 2. the router asked the victim for the stream: hold what it says
            lambda: http_line.stats()["forward"]["bytes"] > polled,
            "the router's stream request to reach the victim",
        )
        http_line.partition(True)
        lines = resp.iter_lines()
        for line in lines:  # 3. the first tokens, from the relay
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                break
        md.link.set_rate(10.0)
        until_sync(
            lambda: relay.metrics().get(HANDOFF, 0.0) > handoffs_before,
            "the relay to hand the request to the victim",
        )
        md.kill()  # 4. the victim dies with the request; its line passes that on
        http_line.partition(False)
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
    assert "".join(text) == mono_text(prompt)
    assert resumes(router.url) == 1
