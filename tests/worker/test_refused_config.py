"""Engine settings this machine refuses keep the worker up, not ready, saying why.

A worker that exited on them would crash-loop on Kubernetes. The machine is a faked
``DeviceProbe`` (a CPU without bfloat16, no CUDA), so these pass the same on any host.
(bfloat16 on such a CPU is not refused: it runs, with a warning; ``test_device``.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from pdd.common.wire import WorkerRefusal
from pdd.local.cluster import free_port
from pdd.testing.waiting import DEFAULT_TIMEOUT_S, until_sync
from pdd.worker.engine import EngineConfigError
from pdd.worker.engine.device import DeviceProbe
from pdd.worker.refused_config import WAN_TLS_FILES, create_refused_app, log_line
from pdd.worker.server import build_engine, parse_args, wan_tls
from pdd.worker.transport import TlsConfigError

#: A machine with no CUDA device and a CPU without native bfloat16.
PLAIN_CPU = DeviceProbe(lambda: False, lambda device: 8 << 30, lambda: False)
NO_CUDA = "no CUDA device is visible: request nvidia.com/gpu"

#: ``pdd worker`` (the same ``server.main``) on ``PLAIN_CPU``: the argv after ``-c``.
LAUNCH = """
import sys
from pdd.worker import server
from pdd.worker.engine.device import DeviceProbe
probe = DeviceProbe(lambda: False, lambda device: 8 << 30, lambda: False)
sys.exit(server.main(sys.argv[1:], probe))
"""


def worker_args(*extra: str) -> list[str]:
    return ["--role", "prefill", "--instance-id", "pod-0", *extra]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (("--device", "cuda"), NO_CUDA),
        (("--kv-cache-gib", "100"), "GiB was asked for"),
    ],
)
def test_what_this_machine_cannot_do_is_a_configuration_refusal(flags, reason):
    """What ``run`` turns into the refused-config server rather than an exit."""
    with pytest.raises(EngineConfigError, match=reason):
        build_engine(parse_args(worker_args(*flags)), PLAIN_CPU)


@pytest.mark.unit
def test_the_log_line_says_what_was_asked_what_is_here_and_what_to_change():
    refusal = WorkerRefusal(
        role="prefill", instance_id="pod-0", problem=f"device 'cuda' asked for, but {NO_CUDA}"
    )
    line = log_line(refusal, "0.0.0.0:8000")
    assert "\n" not in line
    assert line.startswith("prefill pod-0: engine settings refused on this machine: device")
    assert "request nvidia.com/gpu" in line and "0.0.0.0:8000" in line


@pytest.mark.unit
def test_wan_tls_files_that_do_not_load_are_a_refusal_naming_the_file(tmp_path):
    """A broken WAN TLS Secret: refused at start (the data plane never opens), said once."""
    (tmp_path / "tls.crt").write_text("not a certificate")
    args = parse_args(worker_args("--wan", "127.0.0.1:0", "--wan-tls-dir", str(tmp_path)))
    with pytest.raises(TlsConfigError, match=r"lacks tls\.key, ca\.crt"):
        wan_tls(args)
    with pytest.raises(TlsConfigError, match="needs --wan"):
        wan_tls(parse_args(worker_args("--wan-tls-dir", str(tmp_path))))
    refusal = WorkerRefusal(role="main", instance_id="pod-2", problem="x lacks ca.crt")
    line = log_line(refusal, "0.0.0.0:8000", WAN_TLS_FILES)
    assert line.startswith("main pod-2: WAN TLS files refused: x lacks ca.crt (the Secret of")


@pytest.mark.unit
async def test_the_refused_app_is_not_ready_and_says_why():
    problem = f"device 'cuda' asked for, but {NO_CUDA}"
    app = create_refused_app(WorkerRefusal(role="relay", instance_id="pod-1", problem=problem))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        ready = await client.get("/ready")
        assert ready.status_code == 503 and problem in ready.text
        # Started and live: kubelet must not restart it into the same refusal (a crash loop).
        assert (await client.get("/startup")).status_code == 200
        assert (await client.get("/live")).status_code == 200
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "misconfigured",
            "problem": problem,
            "role": "relay",
            "instance_id": "pod-1",
        }
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
        assert "pdd_worker_config_refused 1.0" in metrics.text.splitlines()
        load = await client.get("/load")  # what a router would poll: refused, with the reason
        assert load.status_code == 503
        assert load.json()["error"]["type"] == "misconfigured"
        assert problem in load.json()["error"]["message"]


@pytest.mark.integration
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_refused_worker_process_stays_up_not_ready_and_stops_cleanly(stop):
    http = f"127.0.0.1:{free_port()}"
    argv = worker_args("--device", "cuda", "--http", http, "--data", f"127.0.0.1:{free_port()}")
    cmd = [sys.executable, "-c", LAUNCH, *argv]
    env = {**os.environ, "PDD_SHARED_SECRET": "s3cret"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ready = _wait_answer(f"http://{http}/ready", proc)
        assert ready.status_code == 503 and NO_CUDA in ready.text
        health = httpx.get(f"http://{http}/health", timeout=5)
        assert health.status_code == 503
        assert health.json()["status"] == "misconfigured"
        assert NO_CUDA in health.json()["problem"]
        metrics = httpx.get(f"http://{http}/metrics", timeout=5).text
        assert "pdd_worker_config_refused 1.0" in metrics.splitlines()
        assert proc.poll() is None  # still up: not ready, but no crash for a loop to restart
        proc.send_signal(stop)
        assert proc.wait(timeout=DEFAULT_TIMEOUT_S) == 0
        log = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    refusals = [line for line in log.splitlines() if "engine settings refused" in line]
    assert len(refusals) == 1, log  # said once, in one line
    assert NO_CUDA in refusals[0] and http in refusals[0]
    assert "Traceback" not in log


def _wait_answer(url: str, proc: subprocess.Popen) -> httpx.Response:
    def answer() -> httpx.Response | None:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}: {proc.stderr.read().decode()}")
        try:
            return httpx.get(url, timeout=5)
        except httpx.TransportError:
            return None

    return until_sync(answer, f"{url} answering")
