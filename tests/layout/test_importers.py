"""Every module of a product package is there for the product: something the product
runs imports it, not only tests or benchmarks.

Product packages are the folders setup.py maps (``COMPONENT_ROOTS``) less the benchmarks
(``bench``) and the test harness (``testing``), plus the ``pdd`` command (``cli/``). A
module's importers are read from the source (``pdd.testing.source_tree.importers``):
``import`` statements (relative ones resolved), and strings that name a module exactly,
as the ``pdd`` command's table of subcommands and ``python -m`` command lines do; the
console script in pyproject.toml and the Dockerfiles' commands count as the product's
own. Code only tests or benchmarks use lives with them (``pdd.testing``, ``pdd.bench``,
``bench/``, ``tests/``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdd.testing.source_tree import common_consumers, only_tests_import, read_tree

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_every_product_module_is_imported_by_the_product() -> None:
    tree = read_tree(REPO)
    assert "pdd.router.policy" in tree.product and "pdd.testing.waiting" not in tree.product
    unused = only_tests_import(tree)
    assert not unused, (
        "product modules only tests or benchmarks import (move them to "
        "pdd.testing, pdd.bench or bench/):\n"
        + "\n".join(f"  {module}: {sorted(who) or 'nothing'}" for module, who in unused.items())
    )


def test_common_holds_only_what_two_packages_share() -> None:
    """``pdd.common`` is the bottom layer every image carries: a module there that one
    package alone uses belongs in that package (tests and benchmark scripts follow it)."""
    alone = {m: who for m, who in common_consumers(read_tree(REPO)).items() if len(who) < 2}
    assert not alone, "pdd.common modules with one consumer (move them to it):\n" + "\n".join(
        f"  {module}: {sorted(who) or 'nothing'}" for module, who in alone.items()
    )


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_reading_sees_imports_entry_strings_and_the_build(tmp_path: Path) -> None:
    """On a small tree: a module the tests alone import is listed, with its importers;
    one a product module imports, one the command table names and one a Dockerfile runs
    are not."""
    write_files(tmp_path, {
        "setup.py": 'COMPONENT_ROOTS = ("common", "worker", "testing")\n',
        "cli/pdd/cli.py": 'TABLE = {"worker": "pdd.worker.server"}\n',
        "common/pdd/common/__init__.py": "",
        "common/pdd/common/wire.py": "",
        "worker/pdd/worker/__init__.py": "",
        "worker/pdd/worker/server.py": "from . import engine\nfrom pdd.common import wire\n",
        "worker/pdd/worker/engine.py": "",
        "worker/pdd/worker/kernels.py": "",
        "worker/pdd/worker/memory.py": "",
        "testing/pdd/testing/__init__.py": "from pdd.worker import memory\n",
        "tests/test_memory.py": "import pdd.worker.memory\n",
        "docker/worker.Dockerfile": 'RUN python -c "from pdd.worker.kernels import main"\n',
        "pyproject.toml": '[project.scripts]\npdd = "pdd.cli:main"\n',
    })  # fmt: skip
    unused = only_tests_import(read_tree(tmp_path))
    assert unused == {"pdd.worker.memory": {"pdd.testing", "tests/test_memory.py"}}


def test_common_consumers_count_packages_not_tests(tmp_path: Path) -> None:
    """A common module's consumers are product packages: two modules of one package are
    one; the tests, the benchmarks and the test harness are none; one common module used by
    another counts that one's consumers."""
    write_files(tmp_path, {
        "setup.py": 'COMPONENT_ROOTS = ("common", "router", "worker", "bench", "testing")\n',
        "bench/pdd/bench/__init__.py": "from pdd.common import protocol\n",
        "common/pdd/common/__init__.py": "",
        "common/pdd/common/wire.py": "from pdd.common import base\n",
        "common/pdd/common/base.py": "",
        "common/pdd/common/protocol.py": "",
        "router/pdd/router/__init__.py": "",
        "router/pdd/router/app.py": "from pdd.common import wire, protocol\n",
        "router/pdd/router/errors.py": "from pdd.common.protocol import Error\n",
        "worker/pdd/worker/__init__.py": "",
        "worker/pdd/worker/server.py": "from pdd.common import wire\n",
        "testing/pdd/testing/__init__.py": "from pdd.common import protocol\n",
        "tests/test_protocol.py": "import pdd.common.protocol\n",
    })  # fmt: skip
    consumers = common_consumers(read_tree(tmp_path))
    assert consumers == {
        "pdd.common.base": {"pdd.router", "pdd.worker"},
        "pdd.common.protocol": {"pdd.router"},
        "pdd.common.wire": {"pdd.router", "pdd.worker"},
    }
