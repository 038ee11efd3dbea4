"""The router, the simulator and the shared code must import without torch (their images
and installs lack it)."""

import pkgutil
import subprocess
import sys

import pytest

import pdd.common
import pdd.router
import pdd.simulator

pytestmark = pytest.mark.integration


def _modules(package) -> list[str]:
    return [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def test_router_simulator_and_common_do_not_import_torch():
    modules = _modules(pdd.router) + _modules(pdd.common) + _modules(pdd.simulator)
    assert "pdd.router.policy" in modules and "pdd.common.cost_model" in modules
    assert "pdd.simulator.calibration" in modules and "pdd.simulator.cli" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "leaked = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not leaked, leaked\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
