"""The README's test command needs nothing installed beforehand: ``scripts/setup.sh``
provides a redis-server inside the project's environment where the system has none
(``scripts/provide-redis.sh``), and ``.ci/run`` runs exactly the README's command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROVIDE = REPO / "scripts" / "provide-redis.sh"


def _bin_without_redis(tmp_path: Path) -> Path:
    """A PATH folder with the shell tools the script uses and no redis-server."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("bash", "cut", "cat"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    return bin_dir


def _provide(venv: Path, bin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        [str(bin_dir / "bash"), str(PROVIDE), str(venv)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.integration
def test_without_a_system_redis_server_one_is_installed_into_the_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    done = _provide(venv, _bin_without_redis(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1  # one line says what it did and where
    assert f"as {venv}/bin/redis-server" in done.stdout
    version = subprocess.run(
        [str(venv / "bin" / "redis-server"), "--version"], capture_output=True, text=True
    )
    assert version.stdout.startswith("Redis server v=")
    again = _provide(venv, _bin_without_redis(tmp_path / "again"))
    assert (again.returncode, again.stdout) == (0, "")  # already there: nothing to do


@pytest.mark.integration
def test_a_system_redis_server_is_used_and_nothing_is_installed(tmp_path):
    bin_dir = _bin_without_redis(tmp_path)
    marker = tmp_path / "installed"
    (bin_dir / "redis-server").write_text(f"#!{shutil.which('bash')}\nexit 0\n")
    (bin_dir / "redis-server").chmod(0o755)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake_python = venv / "bin" / "python"  # would install, were it called
    fake_python.write_text(f"#!{shutil.which('bash')}\ntouch {marker}\n")
    fake_python.chmod(0o755)
    done = _provide(venv, bin_dir)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert not marker.exists()


@pytest.mark.unit
def test_ci_calls_exactly_the_readme_test_command_and_installs_nothing():
    readme = (REPO / "README.md").read_text()
    assert "\n./scripts/test.sh\n" in readme
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert lines[-1] == "exec ./scripts/test.sh"
    commands = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', "exec ./scripts/test.sh"]


@pytest.mark.unit
def test_setup_provides_redis_and_test_sh_finds_it_after_the_systems():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "./scripts/provide-redis.sh .venv" in setup
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    assert 'export PATH="$PATH:$PWD/.venv/bin"' in test_sh
    assert test_sh.index("./scripts/setup.sh") < test_sh.index("redis-server --port")
