"""Router test fixtures: tiny tokenizer checkpoints written to tmp (no downloads), and real
``pdd worker`` / ``pdd router`` processes on loopback for the integration tests."""

import json
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from tokenizers import Tokenizer

from pdd.testing.tokenizers import train_byte_bpe
from pdd.testing.waiting import until_sync

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|im_start|>",
    "<|im_end|>",
]
CORPUS = [
    "hello world, how are you today? The quick brown fox jumps over the lazy dog.",
    'system user assistant tool: weather in Paris is sunny {"city": "Paris"}',
]


def _train_tokenizer(bos: str | None) -> Tokenizer:
    return train_byte_bpe(CORPUS * 20, 500, SPECIAL_TOKENS, bos)


@pytest.fixture
def write_checkpoint(tmp_path):
    """Write tokenizer.json + tokenizer_config.json; returns the directory."""

    def write(chat_template: str | None, bos: str | None, eos: str, name: str = "m") -> Path:
        model_dir = tmp_path / name
        model_dir.mkdir()
        _train_tokenizer(bos).save(str(model_dir / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
        if bos is not None:
            config["bos_token"] = {"__type": "AddedToken", "content": bos, "special": True}
        if chat_template is not None:
            config["chat_template"] = chat_template
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
        return model_dir

    return write


# --- real worker processes and router processes (for the integration tests) ---------------


ROUTER_MODEL = "tiny"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One P, one RLD and two MDs (``pdd worker`` processes), the MDs and RLD behind WAN
    link emulators, plus ``md_one``, an MD that runs one request at a time (for the
    saturation tests); started once for every router integration test."""
    from pdd.local.cluster import LinkSpec, LocalCluster, WorkerSpec

    specs = [
        WorkerSpec("p", "prefill"),
        WorkerSpec("rld", "relay", wan_facing=True),
        WorkerSpec("md1", "main", wan_facing=True),
        WorkerSpec("md2", "main", wan_facing=True),
        WorkerSpec("md_one", "main", wan_facing=True, args=("--max-running-requests", "1")),
    ]
    common = ["--model", "tiny", "--num-blocks", "512", "--torch-threads", "1"]
    c = LocalCluster.start(
        specs, tmp_path_factory.mktemp("workers"), LinkSpec(gbps=10.0), common_args=common
    )
    yield c
    c.stop()


@dataclass
class RouterProc:
    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="session")
def worker_flags(cluster):
    """``--prefill/--relay/--main`` flags naming the cluster's workers."""

    def flags(mains: tuple[str, ...] = ("md1", "md2")) -> list[str]:
        out = ["--prefill", f"p={cluster['p'].url}", "--relay", f"rld={cluster['rld'].url}"]
        for name in mains:
            out += ["--main", f"{name}={cluster[name].url}"]
        return out

    return flags


@pytest.fixture(scope="module")
def start_router(tmp_path_factory):
    """Start ``pdd router`` processes under one ``Supervisor``; it stops them all when
    the test module ends."""
    from pdd.local.cluster import ADDRESS_IN_USE, PORT_ATTEMPTS, free_port
    from pdd.local.supervisor import Supervisor, spawn_pdd

    supervisor = Supervisor()
    tmp_path = tmp_path_factory.mktemp("routers")

    def start(
        *args: str,
        secret: str = "pdd-local-secret",
        ready: bool = True,
        env: dict[str, str] | None = None,
    ) -> RouterProc:
        env = {"PDD_SHARED_SECRET": secret, **(env or {})}
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = free_port()
            log = tmp_path / f"router-{port}.log"
            argv = [
                "router", "--model", ROUTER_MODEL, "--host", "127.0.0.1", "--port", str(port),
                "--poll-interval-s", "0.2", *args,
            ]  # fmt: skip
            proc = spawn_pdd(argv, log, env)
            supervisor.add(f"router-{port}", proc, log, env)
            router = RouterProc(f"http://127.0.0.1:{port}", proc, log)
            try:
                wait_http(router, "/ready" if ready else "/health")
                return router
            except RuntimeError:
                # free_port's port may be bound by another process first: try a new one.
                if ADDRESS_IN_USE not in router.log_tail() or attempt == PORT_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    yield start
    supervisor.stop()


def wait_http(router: RouterProc, path: str) -> None:
    def answers() -> bool:
        if router.proc.poll() is not None:
            raise RuntimeError(f"router exited {router.proc.returncode}:\n{router.log_tail()}")
        try:
            return httpx.get(router.url + path, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    until_sync(answers, f"router {path} answering 200 (log: {router.log})")


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of our own, which the test may kill and restart (a ``Supervisor``
    child: stopped at the end, whatever state the test left it in)."""
    from pdd.local.cluster import free_port
    from pdd.local.supervisor import Child, Supervisor, spawn_process

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH")
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(tmp_path)]
    supervisor = Supervisor()

    class Server:
        url = f"redis://127.0.0.1:{port}/0"
        child: Child | None = None

        @property
        def proc(self) -> subprocess.Popen:
            assert self.child is not None
            return self.child.proc

        def start(self) -> None:
            if self.child is None:
                log = tmp_path / "redis.log"
                self.child = supervisor.add("redis", spawn_process(argv, log, {}), log)
            else:
                self.child.restart()
            until_sync(lambda: _pings(self.url), "redis-server answering")

        def kill(self) -> None:
            self.proc.kill()
            self.proc.wait(10)

        def pause(self) -> None:
            """Hang it: connections are still accepted (by the kernel), nothing answers."""
            self.proc.send_signal(signal.SIGSTOP)

        def resume(self) -> None:
            self.proc.send_signal(signal.SIGCONT)

    server = Server()
    server.start()
    yield server
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
    supervisor.stop()


def _pings(url: str) -> bool:
    try:
        return redis.Redis.from_url(url, socket_connect_timeout=0.2).ping()
    except redis.RedisError:
        return False
