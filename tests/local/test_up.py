"""``pdd up`` for real: child processes, the OpenAI client, a bench smoke run, Ctrl-C.

One stack (pdd mode: router, P, RLD, MD, two WAN link emulators) serves the client and
bench tests; the Ctrl-C test stops a stack of its own (tests run in any order).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pdd.bench import cli as bench
from pdd.common.config_document import API_KEYS_ENV
from pdd.local.cluster import free_port
from pdd.local.probes import by_label, flatten
from pdd.local.stack import StackInfo
from pdd.testing.processes import process_group_members
from pdd.testing.waiting import WaitTimeout, until_sync

pytestmark = pytest.mark.integration

READY_TIMEOUT_S = 240


@dataclass
class Up:
    proc: subprocess.Popen
    output: Path
    info: StackInfo


def wait_ready(proc: subprocess.Popen, output: Path, log_dir: Path) -> StackInfo:
    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"pdd up exited (rc {proc.poll()}):\n{output.read_text()}")
        return "base URL" in output.read_text()

    try:
        until_sync(up, "pdd up printing its base URL", READY_TIMEOUT_S, every_s=0.2)
    except WaitTimeout:
        proc.kill()
        raise
    return StackInfo.load(log_dir / "stack.json")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    yield from start_up(tmp_path_factory.mktemp("up"))


@pytest.fixture
def own_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """A stack for one test, which may stop it."""
    yield from start_up(tmp_path_factory.mktemp("own-up"))


def start_up(tmp: Path, *extra: str, mode: str = "pdd") -> Iterator[Up]:
    output = tmp / "pdd-up.out"
    argv = [sys.executable, "-m", "pdd.cli", "up", "--model", "tiny", "--mode", mode,
            "--port", str(free_port()),
            "--log-dir", str(tmp / "logs"), "--worker-arg=--kv-cache-gib=0.03125",
            *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != API_KEYS_ENV}
    with output.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        yield Up(proc, output, wait_ready(proc, output, tmp / "logs"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_openai_client_streams_a_chat_completion(up: Up) -> None:
    client = openai.OpenAI(
        base_url=up.info.base_url, api_key="unused", max_retries=0, timeout=120.0
    )
    assert [m.id for m in client.models.list().data] == ["tiny"]
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello from the test"}],
        max_tokens=8,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_bench_replays_three_requests_against_the_running_stack(
    up: Up, session_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--trace", str(session_dir), "--url", up.info.base_url, "--modes", "pdd",
            "--stack", str(Path(up.info.log_dir) / "stack.json"), "--max-requests", "3",
            "--tokens-per-block", "16", "--json", str(out), "--out-dir", str(tmp_path),
            "--no-plots", "--no-progress"]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())["modes"]["pdd"]
    assert (result["requests"], result["errors"], result["mismatches"]) == (3, 0, 0)
    for key in ("ttft_p50", "ttft_p90", "ttft_p99"):
        assert result[key] > 0
    assert result["wan_bytes"] > 0  # KV crossed the emulated link
    assert sum(result["pipeline_share"].values()) == pytest.approx(1.0)


def test_pdd_up_says_ready_once_the_router_counts_every_worker(own_up: Up) -> None:
    """The router's /ready answers once P and MD do; the relay joins at its next poll.
    ``pdd up`` waits for it too, so a request sent at once may be relayed."""
    text = httpx.get(f"{own_up.info.router_url}/metrics", timeout=10).text
    ready = by_label(flatten(text), "pdd_router_instances_ready", "role")
    assert ready == {"prefill": 1.0, "relay": 1.0, "main": 1.0, "mono": 0.0}


def test_sigint_stops_every_child(own_up: Up) -> None:
    up = own_up
    pids = list(up.info.pids.values())
    assert len(pids) == 6  # router, p0, rld0, md0, and the two links
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(timeout=60) == 0
    assert "stopped" in up.output.read_text()
    assert [p for p in pids if Path(f"/proc/{p}").exists()] == []
    assert process_group_members(up.proc.pid) == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{up.info.router_url}/health", timeout=2.0)


def test_settings_a_worker_refuses_stop_pdd_up_at_once_with_the_reason(tmp_path: Path) -> None:
    """The worker stays up not-ready (no crash loop on a cluster); ``pdd up`` reads its
    refusal and stops with it instead of waiting for a readiness that cannot come."""
    argv = [sys.executable, "-m", "pdd.cli", "up", "--model", "tiny", "--port", str(free_port()),
            "--log-dir", str(tmp_path / "logs"), "--worker-arg=--device=cuda"]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, stderr = proc.communicate(timeout=READY_TIMEOUT_S)
    assert proc.returncode == 1
    assert "refused its settings: device 'cuda' asked for" in stderr
    assert process_group_members(proc.pid) == []  # every worker it started is gone


def command_lines() -> dict[int, bytes]:
    """Every process's command line this user can read (``ps`` shows the same)."""
    lines = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
    return lines


def test_an_api_key_file_keeps_the_key_off_every_command_line_and_the_curl_sends_it(
    tmp_path: Path,
) -> None:
    """The key reaches the router as a cluster gives it (Secret -> environment): no
    process's argv, no log holds it; the router answers 401 without it, and the curl
    ``pdd up`` prints (which reads the file, not the key) streams an answer."""
    key = f"sk-{secrets.token_hex(16)}"
    keys = tmp_path / "keys"
    keys.write_text(f"\n{key}\n")
    stack = start_up(tmp_path, "--api-key-file", str(keys), mode="mono")
    up = next(stack)
    try:
        members = process_group_members(up.proc.pid)
        assert len(members) >= 3  # pdd up, the router, the worker
        assert [pid for pid, line in command_lines().items() if key.encode() in line] == []
        logs = [f for f in Path(up.info.log_dir).rglob("*") if f.is_file()] + [up.output]
        assert [f for f in logs if key.encode() in f.read_bytes()] == []
        models = f"{up.info.base_url}/models"
        assert httpx.get(models, timeout=30).status_code == 401
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(models, headers=auth, timeout=30).status_code == 200
        (curl,) = [ln for ln in up.output.read_text().splitlines() if ln.startswith("curl ")]
        assert "Authorization: Bearer $(awk " in curl
        done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "data: [DONE]" in done.stdout, done.stdout
    finally:
        stack.close()
