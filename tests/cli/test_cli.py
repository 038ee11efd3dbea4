"""The `pdd` entry point dispatches lazily and reports unknown commands clearly."""

import contextlib
import subprocess
import sys
from importlib.metadata import version

import pytest

from pdd.cli import SUBCOMMANDS, main

#: Tiers per test: some tests here start processes (integration), the rest are unit.


@pytest.mark.unit
def test_help_lists_every_command_aligned_without_doc_markup(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out
    rows = [line for line in out.splitlines() if line.strip().split(" ")[0] in SUBCOMMANDS]
    assert {row.split()[0] for row in rows} == set(SUBCOMMANDS)
    # one line per command, every help text starting in the same column
    columns = {len(row) - len(row.lstrip().split(" ", 1)[1].lstrip()) for row in rows}
    assert len(columns) == 1, rows


@pytest.mark.unit
def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pdd {version('pdd')}"


@pytest.mark.unit
def test_unknown_command_is_a_usage_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


@pytest.mark.integration
def test_cli_itself_does_not_import_torch():
    code = "import sys, pdd.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "command_line", "started_again"),
    [
        (None, ["pdd", "generate", "--help"], True),
        (None, ["pdd", "router", "--help"], False),  # no engine: glibc is fine
        (["generate", "--help"], None, False),  # a caller's main(argv) is never replaced
    ],
)
def test_engine_commands_start_again_under_tcmalloc_only_as_the_program(
    monkeypatch, capsys, argv, command_line, started_again
):
    from pdd.worker import cpu_allocator

    calls = []
    monkeypatch.setattr(cpu_allocator, "reexec_with_tcmalloc", lambda: calls.append(1))
    if command_line:
        monkeypatch.setattr(sys, "argv", command_line)
    with contextlib.suppress(SystemExit):  # --help: some commands exit, some return 0
        main(argv)
    assert calls == ([1] if started_again else [])
