"""The router's calls to MD across the WAN, with WAN TLS on and off, on real processes.

A prefill and a main decode worker (``pdd worker``) and ``pdd router`` run on loopback.
With TLS on (``--wan-tls-dir``, the operator's generated material) MD serves its control
API over TLS 1.3 and the router dials it with https, trusting the deployment's CA. MD
advertises its control API through a wiretap (a TCP proxy that keeps every byte), so
the router's plan, token stream and cancel for MD cross it as they would cross the WAN.
"""

from __future__ import annotations

import functools
import os
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdd.common.wan_tls import CA_FILE, load_wan_ca
from pdd.local.cluster import ADDRESS_IN_USE, HOST, PORT_ATTEMPTS, free_port
from pdd.local.supervisor import spawn_pdd
from pdd.operator.builders.wan_tls import new_wan_tls
from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration

SECRET = "md-https-secret"
PROMPT = [201, 7, 199, 53, 211, 17, 163, 89, 241, 3, 127, 61]


class Wiretap:
    """A TCP proxy on loopback that forwards to ``target`` and keeps what it forwards."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._seen = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def seen(self) -> bytes:
        with self._lock:
            return bytes(self._seen)

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with suppress(OSError):
            while data := src.recv(65536):
                with self._lock:
                    self._seen += data
                dst.sendall(data)
        for sock in (src, dst):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@dataclass
class Workers:
    """One P and one MD, and how the router is told to reach them."""

    prefill_url: str
    main_url: str
    tap: Wiretap
    tls_dir: Path | None

    @property
    def tls(self) -> bool:
        return self.tls_dir is not None

    def router_flags(self, ca_dir: Path | None) -> list[str]:
        flags = ["--prefill", f"p={self.prefill_url}", "--main", f"md={self.main_url}"]
        return flags + (["--wan-tls-dir", str(ca_dir)] if ca_dir is not None else [])


def worker_argv(role: str, name: str, http: int, tls_dir: Path | None) -> list[str]:
    data = free_port()
    argv = ["worker", "--role", role, "--instance-id", name, "--model", "tiny"]
    argv += ["--num-blocks", "256", "--torch-threads", "1", "--http", f"{HOST}:{http}"]
    argv += ["--data", f"{HOST}:{data}", "--advertise-fast", f"{HOST}:{data}"]
    if tls_dir is not None:  # the WAN port of its own that TLS needs
        wan = free_port()
        argv += ["--wan", f"{HOST}:{wan}", "--advertise-wan", f"{HOST}:{wan}"]
        argv += ["--wan-tls-dir", str(tls_dir)]
    return argv


def answers(url: str, verify: ssl.SSLContext | bool, proc: subprocess.Popen, log: Path) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    try:
        return httpx.get(url, timeout=2.0, verify=verify).status_code == 200
    except httpx.HTTPError:
        return False


def write_material(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir()
    for name, pem in files.items():
        (folder / name).write_text(pem)
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["tls", "plaintext"])
def workers(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Workers]:
    tls = request.param
    tmp = tmp_path_factory.mktemp("md-https-tls" if tls else "md-https-plain")
    tls_dir = write_material(tmp / "wan-tls", new_wan_tls("chat").files()) if tls else None
    for attempt in range(1, PORT_ATTEMPTS + 1):
        stack = ExitStack()
        try:
            started = start_workers(stack, tmp / f"attempt-{attempt}", tls_dir)
            break
        except RuntimeError as exc:  # a port free_port handed out was taken before the bind
            stack.close()
            if ADDRESS_IN_USE not in str(exc) or attempt == PORT_ATTEMPTS:
                raise
    with stack:
        yield started


def start_workers(stack: ExitStack, logs: Path, tls_dir: Path | None) -> Workers:
    """P and MD on ports drawn now, ready; their clean-up goes on ``stack``."""
    logs.mkdir()
    env = {**os.environ, "PDD_SHARED_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    p_http, md_http = free_port(), free_port()
    tap = Wiretap((HOST, md_http))
    stack.callback(tap.close)
    main_argv = worker_argv("main", "md", md_http, tls_dir)
    main_argv += ["--advertise-http", f"{HOST}:{tap.port}"]  # the router's calls cross the tap
    urls = {
        "p": f"http://{HOST}:{p_http}",
        "md": f"{'https' if tls_dir is not None else 'http'}://{HOST}:{md_http}",
    }
    verify: ssl.SSLContext | bool = load_wan_ca(tls_dir) if tls_dir is not None else True
    started = []
    for name, argv in (("p", worker_argv("prefill", "p", p_http, tls_dir)), ("md", main_argv)):
        log = logs / f"{name}.log"
        proc = spawn_pdd(argv, log, env)
        stack.callback(stop, proc)
        started.append((urls[name], proc, log))
    for url, proc, log in started:
        ready = functools.partial(answers, f"{url}/ready", verify, proc, log)
        until_sync(ready, f"{url}/ready")
    return Workers(urls["p"], urls["md"], tap, tls_dir)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def ready_count(router_url: str, role: str) -> float:
    """The router's ``pdd_router_instances_ready`` for ``role``."""
    for line in httpx.get(f"{router_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'pdd_router_instances_ready{{role="{role}"}}'):
            return float(line.split()[-1])
    return 0.0


def complete(router_url: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{router_url}/v1/completions", json=body, timeout=120)


def test_the_wire_to_md_shows_the_prompt_and_stream_only_without_tls(
    workers: Workers, start_router
) -> None:
    router = start_router(*workers.router_flags(workers.tls_dir), secret=SECRET)
    answer = complete(router.url)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"]
    wire = workers.tap.seen()
    assert len(wire) > 1000  # MD's token stream crossed the tap
    # What a wiretap on the WAN reads in plaintext, and not under TLS: the API path with
    # the request id, the bearer secret, and the stream's events with their token IDs.
    # (The prompt's IDs reach MD from P on the data plane: TLS tests in worker/transport.)
    for needle in (b"/v1/pdd/requests/", SECRET.encode(), b'"token_id":'):
        assert (needle in wire) is not workers.tls, needle


def test_a_plaintext_client_gets_nothing_from_mds_tls_port_and_md_serves_on(
    workers: Workers,
) -> None:
    if not workers.tls:
        pytest.skip("MD's control API is plaintext without WAN TLS")
    plain = workers.main_url.replace("https://", "http://", 1)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/health", timeout=10)
    assert workers.tls_dir is not None
    again = httpx.get(f"{workers.main_url}/health", timeout=10, verify=load_wan_ca(workers.tls_dir))
    assert again.status_code == 200 and again.json()["endpoint"]["instance_id"] == "md"


def test_the_router_leaves_out_an_md_whose_certificate_is_from_another_ca(
    workers: Workers, start_router, tmp_path: Path
) -> None:
    if not workers.tls:
        pytest.skip("only https workers present a certificate")
    other = write_material(tmp_path / "other", {CA_FILE: new_wan_tls("other").ca})
    router = start_router(*workers.router_flags(other), secret=SECRET, ready=False)
    until_sync(lambda: ready_count(router.url, "prefill") == 1, "the router to see P")
    refused = "main worker at https://"
    until_sync(lambda: refused in router.log_tail(), "the router to log MD as left out")
    (line,) = [entry for entry in router.log_tail().splitlines() if refused in entry]
    assert "left out" in line and "does not chain to the deployment's CA" in line, line
    assert ready_count(router.url, "main") == 0
    answer = complete(router.url)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["message"] and "Traceback" not in answer.text
    assert "Traceback" not in router.log_tail()
