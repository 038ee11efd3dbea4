"""Model names: tiny, paths, built-ins and Hub repos resolve to what a pull left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd.common import model_store
from pdd.common.model_store import (
    DEFAULT_MODEL,
    MANIFEST,
    ModelNotPulledError,
    default_model,
    hub_repo_problem,
    is_hub_repo,
    model_dir,
    resolve_model,
)

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDD_MODELS_DIR", str(tmp_path / "models"))
    return tmp_path / "models"


def finish_pull(name: str) -> Path:
    directory = model_dir(name)
    directory.mkdir(parents=True)
    (directory / MANIFEST).write_text(json.dumps({"name": name}))
    return directory


def test_tiny_and_existing_paths_pass_through(tmp_path: Path) -> None:
    assert resolve_model("tiny") == "tiny"
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_a_name_not_pulled_says_how_to_pull_it() -> None:
    with pytest.raises(ModelNotPulledError, match=f"pdd models pull {DEFAULT_MODEL}"):
        resolve_model(DEFAULT_MODEL)
    with pytest.raises(ModelNotPulledError, match="pdd models pull acme/llm"):
        resolve_model("acme/llm")
    with pytest.raises(ModelNotPulledError, match="pdd models list"):
        resolve_model("no-such-model")


def test_a_pull_is_found_only_once_its_manifest_is_written() -> None:
    partial = model_dir("acme/llm")
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")  # a pull cut short: no manifest
    with pytest.raises(ModelNotPulledError):
        resolve_model("acme/llm")
    (partial / MANIFEST).write_text(json.dumps({"name": "acme/llm"}))
    assert resolve_model("acme/llm") == str(partial)
    assert partial.parent.name == "hub" and partial.name == "acme--llm"
    assert [name for name, _, _ in model_store.list_cached()] == ["acme/llm"]


def test_default_model_is_the_pulled_builtin_else_tiny_in_one_line() -> None:
    said: list[str] = []
    assert default_model(said.append) == "tiny"
    assert len(said) == 1 and "random weights" in said[0] and DEFAULT_MODEL in said[0]
    path = finish_pull(DEFAULT_MODEL)
    said.clear()
    assert default_model(said.append) == str(path)
    assert said == []


def test_hub_names_are_org_slash_name_and_not_paths(tmp_path: Path) -> None:
    assert is_hub_repo("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_hub_repo("./org/name")
    assert not is_hub_repo("/abs/path")
    assert not is_hub_repo("a/b/c")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not is_hub_repo(str(tmp_path / "org" / "name"))


@pytest.mark.parametrize(
    "name", ["evil/..", "org/repo;id", "org/a--b", "org/x.git", "org/.x", "org/x-", "o/a b"]
)
def test_a_name_huggingface_hub_would_refuse_is_no_repo_id_to_resolve(name: str) -> None:
    assert is_hub_repo(name)  # ORG/NAME in shape, so it must be checked as an id
    assert hub_repo_problem(name) is not None
    with pytest.raises(ModelNotPulledError, match="not a Hub repo id: ORG/NAME"):
        resolve_model(name)


def test_real_repo_ids_are_ids() -> None:
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "a/b"):
        assert hub_repo_problem(name) is None
