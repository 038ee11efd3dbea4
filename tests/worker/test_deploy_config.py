"""A worker pod starts from the config the operator renders, identity from the pod env."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from pdd.common.config_document import (
    CONFIG_VERSION,
    ConfigDocumentError,
    parse_config_document,
    read_config_document,
)
from pdd.local.cluster import free_port
from pdd.operator.builders.config import build_worker_config
from pdd.operator.builders.meta import Site
from pdd.operator.naming import Owner
from pdd.operator.spec import PDDSpec
from pdd.testing.waiting import until_sync
from pdd.worker.deploy_config import document_values
from pdd.worker.model.config import tiny_config
from pdd.worker.server import build_settings, parse_args
from pdd.worker.transport import AuthError, connect

#: Tiers per test: some tests here start processes (integration), the rest are unit.

EXAMPLE_CR = Path(__file__).parents[2] / "examples" / "node-pools.yaml"
POD_ENV = {"PDD_ROLE": "relay", "PDD_INSTANCE_ID": "qwen-relay-7f9c", "PDD_POD_IP": "10.1.2.3"}


def operator_config(**wan: object) -> dict:
    """The document the operator renders for the example (with ``wan`` set in its
    ``spec.wan``, by the CRD's names), as the JSON a pod reads."""
    docs = [d for d in yaml.safe_load_all(EXAMPLE_CR.read_text()) if d]
    cr = next(d for d in docs if d["kind"] == "PDDDeployment")
    spec = PDDSpec.model_validate({**cr["spec"], "wan": {**cr["spec"]["wan"], **wan}})
    owner = Owner(name=cr["metadata"]["name"], namespace="serving", uid="u")
    return build_worker_config(spec, owner, Site("serving")).to_wire()


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.unit
def test_defaults_come_from_the_rendered_config_and_pod_env():
    doc = operator_config()
    defaults = document_values(parse_config_document(doc, "worker"), POD_ENV)
    kv, wan, http = doc["ports"]["kv"], doc["ports"]["wan"], doc["ports"]["http"]
    assert wan != kv  # peers across the WAN have a port (and a Service) of their own
    assert defaults["role"] == "relay" and defaults["instance_id"] == "qwen-relay-7f9c"
    assert defaults["model"] == doc["model"]["path"]
    assert defaults["data"] == f"0.0.0.0:{kv}" and defaults["http"] == f"0.0.0.0:{http}"
    assert defaults["wan"] == f"0.0.0.0:{wan}"
    assert defaults["advertise_fast"] == f"10.1.2.3:{kv}"
    assert defaults["advertise_wan"] == f"10.1.2.3:{wan}"
    # a document without a WAN port: the kv port serves both, as before
    single = {**doc, "ports": {k: v for k, v in doc["ports"].items() if k != "wan"}}
    defaults = document_values(parse_config_document(single, "worker"), POD_ENV)
    assert "wan" not in defaults and defaults["advertise_wan"] == f"10.1.2.3:{kv}"
    assert defaults["advertise_http"] == f"10.1.2.3:{http}"
    assert defaults["secret_env"] == doc["sharedSecretEnv"]


def with_engine(doc: dict, **roles: dict) -> dict:
    """``doc`` with each named role's (wire-spelled) engine settings replaced."""
    return {**doc, "engine": {**doc["engine"], **roles}}


@pytest.mark.unit
def test_the_engine_settings_are_the_roles_own(tmp_path, monkeypatch):
    doc = with_engine(
        operator_config(),
        relay={"device": "cpu", "kvCacheMemoryFraction": 0.25, "maxRunningRequests": 16},
        main={"kvCacheGiB": 1.5, "maxPromptTokens": 900, "torchThreads": 3},
    )
    path = write(tmp_path, doc)
    for name, value in POD_ENV.items():
        monkeypatch.setenv(name, value)
    relay = parse_args(["--config", str(path)])  # $PDD_ROLE says relay
    assert (relay.device, relay.kv_cache_memory_fraction, relay.max_running_requests) == (
        "cpu", 0.25, 16,
    )  # fmt: skip
    assert relay.kv_cache_gib is None
    main = parse_args(["--config", str(path), "--role", "main"])  # the flag's role, not env's
    assert (main.kv_cache_gib, main.max_prompt_tokens, main.torch_threads) == (1.5, 900, 3)
    # the worker's default, from the settings table
    assert main.kv_cache_memory_fraction is None and main.max_running_requests == 64
    # A KV size on the command line replaces the file's, whichever way it is given;
    # vLLM's name for the fraction is accepted.
    explicit = parse_args(["--config", str(path), "--gpu-memory-utilization", "0.5"])
    assert (explicit.kv_cache_gib, explicit.kv_cache_memory_fraction) == (None, 0.5)
    assert explicit.max_running_requests == 16  # the rest of the file still applies


@pytest.mark.unit
def test_flags_override_the_file(tmp_path, monkeypatch):
    path = write(tmp_path, operator_config())
    for name, value in POD_ENV.items():
        monkeypatch.setenv(name, value)
    args = parse_args(["--config", str(path), "--role", "main", "--model", "tiny"])
    assert args.role == "main" and args.model == "tiny"
    assert args.instance_id == "qwen-relay-7f9c"


@pytest.mark.unit
def test_unknown_config_version_is_refused_with_the_fix(tmp_path, capsys):
    path = write(tmp_path, {**operator_config(), "version": CONFIG_VERSION + 1})
    with pytest.raises(ConfigDocumentError, match="upgrade the worker image"):
        read_config_document(path, "worker")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path), "--role", "main"])
    assert "upgrade the worker image" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigDocumentError, match="not valid JSON"):
        read_config_document(bad, "worker")


@pytest.mark.unit
def test_missing_identity_is_a_usage_error(tmp_path, capsys):
    path = write(tmp_path, operator_config())
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config", str(path)])
    assert exc.value.code == 2
    assert "--role is required" in capsys.readouterr().err


@pytest.mark.integration
def test_worker_process_serves_from_the_operator_config(tmp_path):
    doc = operator_config()
    http_port, kv_port, wan_port = free_port(), free_port(), free_port()
    doc["ports"] = {**doc["ports"], "http": http_port, "kv": kv_port, "wan": wan_port}
    doc["model"] = {**doc["model"], "path": "tiny"}
    doc = with_engine(doc, prefill={"maxRunningRequests": 7, "maxPromptTokens": 100})
    env = {
        **os.environ,
        "PDD_CONFIG": str(write(tmp_path, doc)),
        "PDD_ROLE": "prefill",
        "PDD_INSTANCE_ID": "pod-0",
        "PDD_POD_IP": "127.0.0.1",
        doc["sharedSecretEnv"]: "s3cret",
    }
    cmd = [sys.executable, "-m", "pdd.cli", "worker", "--torch-threads", "1", "--num-blocks", "64"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        health = _wait_health(f"http://127.0.0.1:{http_port}/health", proc)
        assert health["role"] == "prefill"
        engine = health["engine"]  # what it got: the rendered settings, on this machine's CPU
        assert (engine["device"], engine["max_running_requests"], engine["max_prompt_tokens"]) == (
            "cpu",
            7,
            100,
        )
        assert engine["kv_blocks"] == 64 and engine["kv_tokens"] == 64 * engine["block_size"]
        # the KV shape the operator sizes the WAN link with when the spec gives none
        tiny = tiny_config()
        assert engine["kv_shape"] == {
            "num_layers": tiny.num_layers,
            "num_kv_heads": tiny.num_kv_heads,
            "head_dim": tiny.head_dim,
            "dtype": engine["dtype"],
            "bytes_per_token": 2 * tiny.num_layers * tiny.num_kv_heads * tiny.head_dim
            * {"float32": 4, "bfloat16": 2}[engine["dtype"]],
        }  # fmt: skip
        assert engine["kv_bytes"] == engine["kv_tokens"] * engine["kv_shape"]["bytes_per_token"]
        assert health["endpoint"] == {
            "instance_id": "pod-0",
            "http_url": f"http://127.0.0.1:{http_port}",
            "fast_addr": f"127.0.0.1:{kv_port}",
            "wan_addr": f"127.0.0.1:{wan_port}",
        }
        # both data ports speak the peer protocol (the handshake needs the shared secret)
        for port in (kv_port, wan_port):
            asyncio.run(_handshake(port, "s3cret"))
        with pytest.raises(AuthError):
            asyncio.run(_handshake(wan_port, "not-the-secret"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def _handshake(port: int, secret: str) -> None:
    channel = await connect("127.0.0.1", port, secret, "test-peer")
    await channel.close()


def _wait_health(url: str, proc: subprocess.Popen) -> dict:
    def health() -> dict | None:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}: {proc.stderr.read().decode()}")
        try:
            return json.loads(httpx.get(url, timeout=1).text)
        except httpx.TransportError:
            return None

    return until_sync(health, f"{url} answering")


@pytest.mark.unit
def test_the_wan_kv_codec_becomes_the_workers_flag_and_settings(tmp_path, monkeypatch):
    doc = operator_config()
    doc["wan"]["kvCodec"] = "int4"
    path = write(tmp_path, doc)
    for name, value in POD_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PDD_SHARED_SECRET", "s")
    args = parse_args(["--config", str(path), "--role", "prefill"])
    assert args.kv_codec == "int4"
    assert build_settings(args).kv_codec == "int4"
    assert parse_args(["--config", str(path), "--kv-codec", "none"]).kv_codec == "none"


@pytest.mark.unit
def test_the_transfer_timeout_flows_from_the_crd_to_the_workers_settings(tmp_path, monkeypatch):
    """spec.wan.transferTimeoutSeconds -> the operator's document -> the worker's settings;
    the flag (and its older spelling) wins over the file."""
    path = write(tmp_path, operator_config(transferTimeoutSeconds=90))
    for name, value in POD_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PDD_SHARED_SECRET", "s")
    assert build_settings(parse_args(["--config", str(path)])).transfer_timeout_s == 90
    for flag in ("--transfer-timeout-seconds", "--transfer-timeout-s"):
        args = parse_args(["--config", str(path), flag, "5"])
        assert build_settings(args).transfer_timeout_s == 5
    # without the field the worker's default holds
    default = write(tmp_path, operator_config())
    assert build_settings(parse_args(["--config", str(default)])).transfer_timeout_s == 30


@pytest.mark.unit
def test_a_flag_given_at_its_default_still_wins_over_the_file(tmp_path, monkeypatch):
    doc = {**operator_config(), "drainSeconds": 45}
    doc["wan"] = {**doc["wan"], "kvCodec": "int8"}
    path = write(tmp_path, doc)
    for name, value in POD_ENV.items():
        monkeypatch.setenv(name, value)
    args = parse_args(["--config", str(path)])
    assert (args.drain_seconds, args.kv_codec) == (45, "int8")
    args = parse_args(["--config", str(path), "--drain-seconds", "30", "--kv-codec", "none"])
    assert (args.drain_seconds, args.kv_codec) == (30, "none")


@pytest.mark.unit
def test_the_worker_options_are_its_flags_and_the_documents_fields(tmp_path, monkeypatch):
    """One typed model: every setting flag is a ``WorkerOptions`` field (the engine's and the
    WAN's are ``EngineSettings``' and ``WanKVSettings``' own: same help, aliases, bounds),
    the document is read into its fields, and the worker's code gets the model."""
    from typing import get_args

    from pdd.common.config_document import EngineSettings, WanKVSettings
    from pdd.worker.instance import ROLES
    from pdd.worker.options import WorkerOptions, WorkerRole
    from pdd.worker.server import build_parser

    assert sorted(get_args(WorkerRole)) == sorted(ROLES)
    fields = WorkerOptions.model_fields
    flags = {a.dest: a for a in build_parser()._actions if a.option_strings}
    assert set(flags) - set(fields) == {"help", "config"}
    for shared in (EngineSettings, WanKVSettings):
        for name in set(shared.model_fields) & set(flags):
            assert fields[name].description == shared.model_fields[name].description
            if name != "device":  # the worker's also takes cuda:N
                assert fields[name].annotation == shared.model_fields[name].annotation, name
            assert flags[name].help.startswith(shared.model_fields[name].description)
    path = write(tmp_path, operator_config(kvCodec="int8"))
    for name, value in POD_ENV.items():
        monkeypatch.setenv(name, value)
    options = parse_args(["--config", str(path)])
    assert isinstance(options, WorkerOptions)
    doc = read_config_document(path, "worker")
    assert set(document_values(doc, POD_ENV)) <= set(fields)
    assert options.kv_codec == "int8" and options.handoff == doc.handoff.flag


@pytest.mark.unit
@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--kv-cache-gib", "--kv-cache-gib"),
        ("--max-num-seqs", "--max-running-requests"),  # vLLM's name for the setting
        ("--transfer-timeout-s", "--transfer-timeout-seconds"),
    ],
)
def test_a_value_out_of_the_settings_bounds_is_refused_naming_its_flag(flag, named, capsys):
    """The CRD's bounds hold for the flags too (the same fields): exit 2 with the flag."""
    with pytest.raises(SystemExit) as exited:
        parse_args(["--role", "prefill", "--instance-id", "p-0", flag, "0"])
    assert exited.value.code == 2
    assert f"{named}: Input should be greater than" in capsys.readouterr().err
