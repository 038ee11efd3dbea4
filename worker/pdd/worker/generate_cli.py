"""``pdd generate``: run one prompt through the engine from the command line.

The smallest end-to-end use of the inference core, and the reference other
components compare against (``--json`` prints ``{"token_ids": [...]}``, the
generated IDs only). Without ``--json``, a ``--prompt`` prints the generated text; a
``--prompt-ids`` prints the generated IDs (comma-separated, as ``--prompt-ids`` takes
them), then their text when the checkpoint has a tokenizer. ``--prompt-ids`` never
tokenizes, so it also runs a checkpoint that has no ``tokenizer.json``. Bad input is
one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from pdd.common.settings import HelpFormatter
from pdd.worker.engine import Engine, EngineConfigError
from pdd.worker.engine.request import RequestError
from pdd.worker.engine.sampling import SamplingParams
from pdd.worker.model.errors import ModelLoadError
from pdd.worker.model.loader import IdsOnlyTokenizer, load_model

_BLOCK_SIZE = 16


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
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--json", action="store_true", help='print {"token_ids": [...]}')
    return p


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


def run(args: argparse.Namespace) -> dict[str, object]:
    """Generate for the parsed arguments; returns the generated ``token_ids`` and their
    ``text`` (None when the checkpoint has no tokenizer)."""
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    prompt_ids = parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if args.prompt is not None and not args.prompt:
        raise UsageError("--prompt is empty")
    loaded = load_model(
        args.model, args.dtype, check_device(args.device), require_tokenizer=prompt_ids is None
    )
    if prompt_ids is None:
        prompt_ids = loaded.tokenizer.encode(args.prompt)
    length = len(prompt_ids) + args.max_tokens
    engine = Engine(
        loaded,
        block_size=_BLOCK_SIZE,
        num_blocks=-(-length // _BLOCK_SIZE),  # one request: size the pool to it
    )
    (token_ids,) = engine.generate([prompt_ids], params)
    has_tokenizer = not isinstance(loaded.tokenizer, IdsOnlyTokenizer)
    return {
        "token_ids": token_ids,
        "text": loaded.tokenizer.decode(token_ids) if has_tokenizer else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        result = run(args)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except (UsageError, ModelLoadError, RequestError, EngineConfigError, ValueError) as exc:
        print(f"pdd generate: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError as exc:
        print(f"pdd generate: error: out of device memory: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"token_ids": result["token_ids"]}))
    elif args.prompt_ids is None:
        print(result["text"])
    else:
        print(",".join(map(str, result["token_ids"])))
        if result["text"] is not None:
            print(result["text"])
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
