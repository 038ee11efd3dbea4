"""The ``pdd`` command: one entry point that dispatches to each component.

Subcommands import their component lazily, so ``pdd operator`` and ``pdd router``
never import torch (their images do not ship it); each parses its own flags
(``pdd COMMAND --help``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

from pdd.common.parent_watch import watch_parent
from pdd.common.settings import HelpFormatter

#: subcommand -> (module with a ``main(argv) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pdd.local.up", "bring the whole pipeline up on this machine"),
    "router": ("pdd.router.server", "run the OpenAI-compatible router"),
    "models": ("pdd.worker.models_cli", "list, pull and inspect models (built-ins, Hub repos)"),
    "worker": ("pdd.worker.server", "run one worker instance (prefill|relay|main|mono)"),
    "wan-link": ("pdd.wan.cli", "run the WAN link emulator (TCP proxy)"),
    "operator": ("pdd.operator.main", "run the Kubernetes operator, or render manifests"),
    "bench": ("pdd.bench.cli", "replay a trace against a stack and report"),
    "generate": ("pdd.worker.generate_cli", "generate token IDs with the inference core or vLLM"),
    "tiny-tokenizer": ("pdd.local.tiny_tokenizer", "write the tiny model's tokenizer files"),
    "trace": ("pdd.local.trace_view", "print one request's trace as a waterfall (pdd up's spans)"),
    "simulate": ("pdd.simulator.cli", "simulate a datacenter-scale scenario (YAML)"),
    "calibrate": ("pdd.simulator.calibrate_cli", "fit the simulator's step model to a profile"),
    "plan": ("pdd.simulator.planner.cli", "size P, RLD and MD for an SLO at least cost"),
    "plan-day": ("pdd.simulator.planner.day_cli", "simulate a day: planner vs static vs RLD HPA"),
}
#: Commands that run the inference core: started as a program, they execute themselves
#: again with tcmalloc preloaded where it is installed (pdd.worker.cpu_allocator).
ENGINE_COMMANDS = frozenset({"worker", "generate"})


def pdd_version() -> str:
    try:
        return version("pdd")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class _CommandListFormatter(HelpFormatter):
    """Lines the command list up in one column: argparse measures the commands without
    the extra indent it then prints them with, so a long name pushed its help a line down."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            longest = max(len(name) for name in action.choices)
            indent = self._current_indent + self._indent_increment
            self._action_max_length = max(self._action_max_length, longest + indent)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: one subparser per command, whose own flags its module parses."""
    p = argparse.ArgumentParser(
        prog="pdd",
        description="PDD: cross-datacenter prefill / relay-decode / main-decode LLM serving.",
        epilog="Run 'pdd COMMAND --help' for a command's flags.",
        formatter_class=_CommandListFormatter,
    )
    p.add_argument("--version", action="version", version=f"pdd {pdd_version()}")
    commands = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (_, help_) in SUBCOMMANDS.items():
        # The command's own parser (in its module) reads the rest, --help included.
        sub = commands.add_parser(name, help=help_, add_help=False)
        sub.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not args:
        parser.print_help()
        return 0
    if args[0] not in SUBCOMMANDS:
        try:
            parser.parse_args(args)  # --help, --version, or an unknown command
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0
    name, rest = args[0], args[1:]
    if argv is None and name in ENGINE_COMMANDS:
        _preload_tcmalloc()
    if argv is None:  # started as a program (after any re-exec, which keeps the pipe)
        watch_parent()
    module_name, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"pdd {name}: not available in this install ({exc})", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


def _preload_tcmalloc() -> None:
    """Start again under tcmalloc where it applies (only from the program's own command
    line: a caller's ``main(argv)`` is never replaced)."""
    try:
        from pdd.worker.cpu_allocator import reexec_with_tcmalloc
    except ModuleNotFoundError:  # an install without the worker: its command says so
        return
    reexec_with_tcmalloc()


if __name__ == "__main__":
    sys.exit(main())
