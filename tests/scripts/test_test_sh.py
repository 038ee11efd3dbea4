"""``scripts/test.sh`` installs nothing: without redis-server it says what is missing and
how to get it, and stops; ``.ci/run`` installs it, then runs exactly the README's command."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_without_redis_server_it_says_what_to_install_and_installs_nothing(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "cat"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    marker = tmp_path / "installer-ran"
    for installer in ("apt-get", "sudo", "dnf", "brew", "pip"):
        fake = bin_dir / installer
        fake.write_text(f"#!{shutil.which('bash')}\ntouch {marker}\n")
        fake.chmod(0o755)
    done = subprocess.run(
        [str(bin_dir / "bash"), str(REPO / "scripts" / "test.sh"), "-m", "unit"],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "redis-server is not installed" in done.stderr
    assert "apt-get install redis-server" in done.stderr
    assert not marker.exists()  # nothing was installed, nor set up


@pytest.mark.unit
def test_ci_calls_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "\n./scripts/test.sh\n" in readme
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == "exec ./scripts/test.sh"
    assert "apt-get install -y -qq redis-server" in "\n".join(ci)
