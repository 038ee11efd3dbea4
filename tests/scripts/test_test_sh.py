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


def _stub(path: Path, body: str = "") -> None:
    """An executable that appends its folder, name and arguments to the file ``$CALLS``
    names (``.venv-vllm/python -m pytest ...``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    name = f"{path.parent.parent.name}/{path.name}" if path.parent.name == "bin" else path.name
    path.write_text(f'#!{shutil.which("bash")}\necho "{name} $*" >>"$CALLS"\n{body}')
    path.chmod(0o755)


def _run_test_sh(tmp_path: Path, *args: str, **env: str) -> tuple[int, list[str]]:
    """scripts/test.sh in a copy of the repo's scripts whose setup, tools and interpreters
    are stubs: which passes it runs, in which environment, and its exit status."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "test.sh", repo / "scripts" / "test.sh")
    _stub(repo / "scripts" / "setup.sh")
    for tool in ("ruff", "lint-imports", "mypy"):
        _stub(repo / ".venv" / "bin" / tool)
    _stub(repo / ".venv" / "bin" / "python", 'exit "${MAIN_RC:-0}"\n')
    _stub(repo / ".venv-vllm" / "bin" / "python", 'exit "${VLLM_RC:-0}"\n')
    _stub(tmp_path / "bin" / "redis-server")
    calls = tmp_path / "calls.txt"
    done = subprocess.run(
        [shutil.which("bash"), str(repo / "scripts" / "test.sh"), *args],
        env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "CALLS": str(calls), **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return done.returncode, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.integration
def test_the_whole_suite_sets_up_vllm_and_runs_its_tests_in_its_environment(tmp_path):
    rc, calls = _run_test_sh(tmp_path)
    assert rc == 0
    assert calls[0] == "setup.sh --with-vllm"
    assert calls[-2].startswith(".venv/python -m pytest -n 2 --dist loadscope")
    assert calls[-1] == ".venv-vllm/python -m pytest -n 0 tests/worker/vllm"


@pytest.mark.integration
@pytest.mark.parametrize(("args", "env"), [(("-m", "unit"), {}), ((), {"PDD_TEST_VLLM": "0"})])
def test_a_selection_or_pdd_test_vllm_0_leaves_vllm_out(tmp_path, args, env):
    rc, calls = _run_test_sh(tmp_path, *args, **env)
    assert rc == 0
    assert calls[0] == "setup.sh "
    assert not [c for c in calls if "tests/worker/vllm" in c]


@pytest.mark.integration
def test_pdd_test_vllm_1_adds_the_vllm_tests_to_a_selection(tmp_path):
    rc, calls = _run_test_sh(tmp_path, "-m", "slow", PDD_TEST_VLLM="1")
    assert rc == 0
    assert calls[0] == "setup.sh --with-vllm"
    assert calls[-2].startswith(".venv/python") and calls[-2].endswith("-m slow")
    assert calls[-1] == ".venv-vllm/python -m pytest -n 0 tests/worker/vllm"


@pytest.mark.integration
@pytest.mark.parametrize(("main_rc", "vllm_rc"), [("1", "0"), ("0", "1"), ("5", "1")])
def test_a_failure_in_either_pass_fails_the_command(tmp_path, main_rc, vllm_rc):
    rc, calls = _run_test_sh(tmp_path, MAIN_RC=main_rc, VLLM_RC=vllm_rc)
    assert rc != 0
    assert calls[-1].startswith(".venv-vllm/python")  # the vLLM pass runs all the same


@pytest.mark.integration
def test_setup_refuses_an_unknown_argument_before_installing_anything(tmp_path):
    done = subprocess.run(
        [shutil.which("bash"), str(REPO / "scripts" / "setup.sh"), "--with-vlm"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == "setup: unknown argument --with-vlm (known: --with-vllm)\n"
