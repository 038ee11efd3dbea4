"""The ``pdd`` command: one entry point that dispatches to each component.

Subcommands import their component lazily, so ``pdd operator`` and ``pdd router``
never import torch (their images do not ship it).
"""

from __future__ import annotations

import importlib
import sys

#: subcommand -> (module with a ``main(argv) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("pdd.worker.generate_cli", "generate token IDs with the inference core"),
    "models": ("pdd.worker.models_cli", "list, pull and inspect models (built-ins, Hub repos)"),
    "worker": ("pdd.worker.server", "run one worker instance (prefill|relay|main|mono)"),
    "wan-link": ("pdd.wan.cli", "run the WAN link emulator (TCP proxy)"),
    "router": ("pdd.router.server", "run the OpenAI-compatible router"),
    "operator": ("pdd.operator.main", "run the Kubernetes operator"),
    "up": ("pdd.local.up", "bring the whole pipeline up on this machine"),
    "bench": ("pdd.local.bench", "replay a trace against a stack and report"),
    "tiny-tokenizer": ("pdd.local.tiny_tokenizer", "write the tiny model's tokenizer files"),
    "simulate": ("pdd.simulator.cli", "simulate a datacenter-scale scenario (YAML)"),
    "calibrate": ("pdd.simulator.calibrate_cli", "fit the simulator's step model to a profile"),
}


def _usage() -> str:
    lines = ["usage: pdd <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"pdd: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"pdd {name}: not available in this install ({exc})", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
