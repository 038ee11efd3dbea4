"""Every module of a product package is there for the product: something the product
runs imports it, not only tests or benchmarks.

Product packages are the folders setup.py maps (``COMPONENT_ROOTS``) less the benchmarks
(``bench``) and the test harness (``testing``), plus the ``pdd`` command (``cli/``). A
module's importers are read from the source: ``import`` statements (relative ones
resolved), and strings that name a module exactly, as the ``pdd`` command's table of
subcommands and ``python -m`` command lines do; the console script in pyproject.toml
and the Dockerfiles' commands count as the product's own. Importing a module imports
its parent packages too. Code only tests or benchmarks use lives with them
(``pdd.testing``, ``pdd.bench``, ``bench/``, ``tests/``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
#: Folders mapped by setup.py whose code is not the product's.
NOT_PRODUCT = {"bench", "testing"}
MODULE_NAME = re.compile(r"pdd(?:\.\w+)+")


@dataclass(frozen=True)
class Tree:
    """Where each module of the ``pdd`` namespace lives, and which of them are product."""

    modules: Mapping[str, Path]
    product: frozenset[str]


def component_roots(repo: Path) -> tuple[str, ...]:
    """setup.py's ``COMPONENT_ROOTS``, read without running setup()."""
    for node in ast.walk(ast.parse((repo / "setup.py").read_text())):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "COMPONENT_ROOTS" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no COMPONENT_ROOTS")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_tree(repo: Path) -> Tree:
    modules: dict[str, Path] = {}
    product: set[str] = set()
    for folder in (*component_roots(repo), "cli"):
        for path in sorted((repo / folder / "pdd").rglob("*.py")):
            name = module_name(repo / folder, path)
            modules[name] = path
            if folder not in NOT_PRODUCT:
                product.add(name)
    return Tree(modules, frozenset(product))


def named_modules(source: str, path: Path, own: str | None) -> set[str]:
    """Every dotted name ``source`` imports or names exactly as a string."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and own is not None:
                package = own.split(".")
                if path.name != "__init__.py":
                    package.pop()
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([node.module] if node.module else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_NAME.fullmatch(node.value.split(":")[0])
        ):
            names.add(node.value.split(":")[0])
    return names


def resolve(name: str, modules: Mapping[str, Path]) -> set[str]:
    """The module ``name`` is (or the module holding the attribute it names) and the
    packages above it, which importing it imports too."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return {
                ".".join(parts[:i]) for i in range(1, end + 1) if ".".join(parts[:i]) in modules
            }
    return set()


def importers(repo: Path, tree: Tree) -> dict[str, set[str]]:
    """module -> who imports it: a module name, or ``tests/...``, ``bench/...`` and the
    like for files outside the namespace, ``build:...`` for the packaging's own."""
    found: dict[str, set[str]] = {name: set() for name in tree.modules}

    def add(who: str, names: Iterable[str]) -> None:
        for name in names:
            for module in resolve(name, tree.modules):
                if module != who:
                    found[module].add(who)

    for name, path in tree.modules.items():
        add(name, named_modules(path.read_text(), path, name))
    for folder in ("tests", "bench", "e2e", "scripts"):
        for path in sorted((repo / folder).rglob("*.py")):
            if "pdd" not in path.relative_to(repo / folder).parts[:1]:
                add(str(path.relative_to(repo)), named_modules(path.read_text(), path, None))
    for path in [repo / "pyproject.toml", *sorted((repo / "docker").glob("*Dockerfile"))]:
        add(f"build:{path.name}", MODULE_NAME.findall(path.read_text()))
    return found


def modules_only_tests_use(tree: Tree, found: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """Product modules that nothing of the product imports, with who does."""
    return {
        module: who
        for module, who in sorted(found.items())
        if module in tree.product
        and not any(w in tree.product or w.startswith("build:") for w in who)
    }


def test_every_product_module_is_imported_by_the_product() -> None:
    tree = read_tree(REPO)
    found = importers(REPO, tree)
    assert "pdd.router.policy" in tree.product and "pdd.testing.waiting" not in tree.product
    unused = modules_only_tests_use(tree, found)
    assert not unused, (
        "product modules only tests or benchmarks import (move them to "
        "pdd.testing, pdd.bench or bench/):\n"
        + "\n".join(f"  {module}: {sorted(who) or 'nothing'}" for module, who in unused.items())
    )


def test_the_reading_sees_imports_entry_strings_and_the_build(tmp_path: Path) -> None:
    """On a small tree: a module the tests alone import is listed, with its importer;
    one a product module imports, one the command table names and one a Dockerfile runs
    are not."""
    (tmp_path / "setup.py").write_text('COMPONENT_ROOTS = ("common", "worker", "testing")\n')
    files = {
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
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    tree = read_tree(tmp_path)
    unused = modules_only_tests_use(tree, importers(tmp_path, tree))
    assert unused == {"pdd.worker.memory": {"pdd.testing", "tests/test_memory.py"}}
