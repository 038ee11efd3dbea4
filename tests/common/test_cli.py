"""The `pdd` entry point dispatches lazily and reports unknown commands clearly."""

import subprocess
import sys

import pytest

from pdd.cli import main

#: Tiers per test: some tests here start processes (integration), the rest are unit.


@pytest.mark.unit
def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out


@pytest.mark.unit
def test_unknown_command_is_a_usage_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


@pytest.mark.integration
def test_cli_itself_does_not_import_torch():
    code = "import sys, pdd.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
