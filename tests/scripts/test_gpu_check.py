"""scripts/gpu-check.sh where there is no GPU (every machine of this project's): one line
saying so, exit 0, nothing written; and the check's parity verdict (scripts/gpu_check.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _gpu_check(tmp_path: Path, nvidia_smi: str | None) -> subprocess.CompletedProcess[str]:
    """The script with PATH holding only the tools it needs, and ``nvidia-smi`` as given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "grep", "sed", "head", "dirname"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    if nvidia_smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!{shutil.which('bash')}\n{nvidia_smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    return subprocess.run(
        [str(bin_dir / "bash"), str(REPO / "scripts" / "gpu-check.sh"), str(tmp_path / "o.json")],
        env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize(
    "nvidia_smi",
    [None, 'echo "NVIDIA-SMI has failed because it could not communicate with the driver"; exit 9'],
    ids=["no-nvidia-smi", "no-driver"],
)
def test_without_a_gpu_it_says_so_in_one_line_and_measures_nothing(tmp_path, nvidia_smi):
    done = _gpu_check(tmp_path, nvidia_smi)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (
        f"gpu-check: no GPU here (nvidia-smi lists none): nothing measured, "
        f"{tmp_path / 'o.json'} not written\n"
    )
    assert not (tmp_path / "o.json").exists()


def _check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_parity_counts_the_prompts_every_engine_answered_alike() -> None:
    parity = _check_module().parity
    answers = lambda *texts: {"answers": [{"text": t} for t in texts]}  # noqa: E731
    assert parity({"vllm": answers("Paris", "2, 3, 5"), "pdd": answers("Paris", "2, 3, 7")}) == {
        "compared": ["pdd", "vllm"], "equal": 1, "of": 2, "all_equal": False,
    }  # fmt: skip
    assert parity({"vllm": answers("Paris"), "pdd": answers("Paris")})["all_equal"]
    # An engine that failed to answer is no comparison (its error says why).
    assert parity({"vllm": {"error": "StepTimeout: ..."}, "pdd": answers("Paris")}) is None
