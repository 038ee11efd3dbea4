"""``pdd generate``: run one prompt through the engine from the command line.

The smallest end-to-end use of the inference core, and the reference other
components compare against (``--json`` prints ``{"token_ids": [...]}``, the
generated IDs only). Without ``--json``, a ``--prompt`` prints the generated text; a
``--prompt-ids`` prints the generated IDs (comma-separated, as ``--prompt-ids`` takes
them), then their text when the checkpoint has a tokenizer. ``--prompt-ids`` never
tokenizes, so it also runs a checkpoint that has no ``tokenizer.json``. Bad input is
one line on stderr and exit code 2.

``--engine vllm`` runs the same prompt IDs (a ``--prompt`` encoded by the same
tokenizer) through vLLM offline instead (``pdd.worker.vllm.offline``; float32 unless
``--dtype`` says otherwise), so one command is the reference for both engines. With
``--kv-store DIR`` it does the PDD connector's moves by hand: ``--export-kv KEY`` (P's:
the prompt's KV goes to DIR under KEY) or ``--import-kv KEY`` (MD's: the KV of all
that KEY holds, for a prompt that starts with the exported one, e.g. P's prompt plus
handed-over IDs). Its ``--json`` adds the prompt IDs, ``num_cached_tokens`` (the prompt
tokens vLLM did not compute) and the connector's ``kv_transfer_params``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import torch
from pydantic import ValidationError

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.common.settings import HelpFormatter, add_settings, settings_of
from pdd.common.tokenizer import HFTokenizer
from pdd.worker.engine import Engine, EngineConfigError
from pdd.worker.engine.request import RequestError
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.errors import ModelLoadError
from pdd.worker.model.loader import IdsOnlyTokenizer, load_model
from pdd.worker.options import VllmOnlySettings
from pdd.worker.vllm import offline
from pdd.worker.vllm.engine_args import VllmEngineSettings
from pdd.worker.vllm.params import export_params
from pdd.worker.vllm.worker_config import DEFAULT_KV_BYTES, checkpoint

#: Flags only ``--engine vllm`` reads, and their defaults.
_VLLM_ONLY = {
    "max_model_len": None,
    "max_num_batched_tokens": None,
    "gpu_memory_utilization": None,
    "kv_cache_memory_bytes": None,
    "tensor_parallel_size": 1,
    "kv_cache_dtype": "auto",
    "enforce_eager": False,
    "kv_store": None,
    "export_kv": None,
    "import_kv": None,
}
_BYTES = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


class Generated(TypedDict):
    """What ``run`` returns: the generated IDs, their text (None without a tokenizer) and,
    with ``--engine vllm``, the fields its ``--json`` adds."""

    token_ids: list[int]
    text: str | None
    details: NotRequired[dict[str, object]]


class UsageError(Exception):
    """Bad command-line input; main() prints it on one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pdd generate",
        description=__doc__.splitlines()[0].replace("``", ""),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--model", required=True,
        help="'tiny' (random weights, for tests), a checkpoint directory or a GGUF file",
    )  # fmt: skip
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", help="comma-separated token IDs, e.g. 1,2,3")
    prompt.add_argument("--prompt", help="text, encoded with the model's tokenizer")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0: all")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument(
        "--dtype", default=None,
        help="compute dtype: float32, bfloat16 or float16 (default: the checkpoint's)",
    )  # fmt: skip
    p.add_argument(
        "--device", default="cpu",
        help="the pdd engine's device: cpu, cuda or cuda:N (vLLM runs where its build does)",
    )  # fmt: skip
    p.add_argument(
        "--engine", choices=("pdd", "vllm"), default="pdd",
        help="the inference core, or vLLM offline (the pdd[vllm] extra)",
    )  # fmt: skip
    p.add_argument(
        "--block-size", type=int, default=None,
        help="tokens per KV block (default: 16; with --engine vllm, vLLM's)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...]}')
    _add_vllm_flags(p.add_argument_group("--engine vllm (vLLM's own flag names)"))
    return p


def _add_vllm_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--max-model-len", type=int, default=None,
        help="context window (default: the prompt plus --max-tokens)",
    )  # fmt: skip
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="per-step token budget; longer prompts are computed in chunks (default: vLLM's)",
    )  # fmt: skip
    g.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="share of the device memory vLLM takes (default: vLLM's)",
    )  # fmt: skip
    g.add_argument(
        "--kv-cache-memory-bytes", type=parse_bytes, default=None,
        help="KV cache size, e.g. 256M or 1G (default: 256M unless --gpu-memory-utilization; "
        "$VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it on the CPU)",
    )  # fmt: skip
    add_settings(g, settings_of(VllmOnlySettings))  # vLLM's own settings, as pdd worker's
    g.add_argument(
        "--kv-store", default=None,
        help="folder where instances exchange KV through the PDD connector",
    )  # fmt: skip
    move = g.add_mutually_exclusive_group()
    move.add_argument("--export-kv", metavar="KEY", help="P's move: export the prompt's KV")
    move.add_argument(
        "--import-kv", metavar="KEY",
        help="MD's move: import all the KV stored under KEY (the prompt starts with its tokens)",
    )  # fmt: skip


def parse_bytes(text: str) -> int:
    """A byte count as vLLM writes one: 256M, 1G (upper case binary, lower case decimal)."""
    match = _BYTES.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 268435456, 256M, 1G)")
    number, unit = match.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    return int(float(number) * (1024 if unit.isupper() else 1000) ** power)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty; pass at least one token id")
    return ids


def check_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a torch device (cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here; use --device cpu")
    return device


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags, checked by the pdd engine's rules whichever engine runs; a value
    out of range is a usage error naming its flag."""
    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    except ValidationError as exc:
        problems = "; ".join(
            f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}" for err in exc.errors()
        )
        raise UsageError(problems) from None


def run(args: argparse.Namespace) -> Generated:
    """Generate for the parsed arguments; returns the generated ``token_ids`` and their
    ``text`` (None when the checkpoint has no tokenizer), and with ``--engine vllm`` the
    fields its ``--json`` adds."""
    if args.block_size is not None and args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size}")
    if args.engine == "vllm":
        return run_vllm(args)
    given = [name for name, default in _VLLM_ONLY.items() if getattr(args, name) != default]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"{flag} is a flag of --engine vllm")
    params = sampling_params(args)
    prompt_ids = parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if args.prompt == "":
        raise UsageError("--prompt is empty")
    loaded = load_model(
        args.model, args.dtype, check_device(args.device), require_tokenizer=prompt_ids is None
    )
    if prompt_ids is None:
        prompt_ids = loaded.tokenizer.encode(args.prompt)
    length = len(prompt_ids) + args.max_tokens
    block_size = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
    engine = Engine(
        loaded,
        block_size=block_size,
        num_blocks=-(-length // block_size),  # one request: size the pool to it
    )
    (token_ids,) = engine.generate([prompt_ids], params)
    has_tokenizer = not isinstance(loaded.tokenizer, IdsOnlyTokenizer)
    return {
        "token_ids": token_ids,
        "text": loaded.tokenizer.decode(token_ids) if has_tokenizer else None,
    }


def run_vllm(args: argparse.Namespace) -> Generated:
    """``run`` with vLLM: the same prompt IDs and sampling, the connector's move if asked."""
    params = sampling_params(args)
    if args.device != "cpu":
        raise UsageError("--device is the pdd engine's; vLLM runs where its build does")
    model = Path(checkpoint(args.model))
    has_tokenizer = (model / "tokenizer.json").is_file()
    tokenizer = HFTokenizer(model / "tokenizer.json", ()) if has_tokenizer else None
    if args.prompt_ids is not None:
        prompt_ids = parse_ids(args.prompt_ids)
    elif not args.prompt:
        raise UsageError("--prompt is empty")
    elif tokenizer is None:
        raise UsageError(f"{model / 'tokenizer.json'} not found; pass --prompt-ids")
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    if (args.export_kv or args.import_kv) and not args.kv_store:
        raise UsageError("--export-kv and --import-kv need --kv-store DIR")
    transfer: dict[str, Any] | None
    if args.import_kv:
        transfer = offline.import_transfer(args.kv_store, args.import_kv, prompt_ids)
    else:
        transfer = export_params(args.export_kv) if args.export_kv else None
    kv_bytes = args.kv_cache_memory_bytes
    if kv_bytes is None and args.gpu_memory_utilization is None:
        kv_bytes = DEFAULT_KV_BYTES  # ample for one prompt (vLLM's own: 90% of memory)
    settings = VllmEngineSettings(
        model=str(model),
        dtype=args.dtype or "float32",
        block_size=args.block_size,
        max_model_len=args.max_model_len or len(prompt_ids) + args.max_tokens,
        max_num_seqs=1,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=kv_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
        seed=0,
        kv_store_dir=args.kv_store,
    )
    out = offline.generate(settings, prompt_ids, params, transfer)
    return {
        "token_ids": out.token_ids,
        "text": tokenizer.decode(out.token_ids) if tokenizer is not None else None,
        "details": {
            "prompt_token_ids": prompt_ids,
            "num_cached_tokens": out.num_cached_tokens,
            "kv_transfer_params": out.kv_transfer_params,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        result = run(args)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (
        UsageError, ModelLoadError, RequestError, EngineConfigError, ValueError,
        offline.VllmNotInstalledError,
    ) as exc:  # fmt: skip
        print(f"pdd generate: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError as exc:
        print(f"pdd generate: error: out of device memory: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"token_ids": result["token_ids"], **result.get("details", {})}))
    elif args.prompt_ids is None:
        print(result["text"])
    else:
        print(",".join(map(str, result["token_ids"])))
        if result["text"] is not None:
            print(result["text"])
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
