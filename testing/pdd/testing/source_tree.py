"""The repository's Python source as data, read without importing it: where each module
of the ``pdd`` namespace lives, which names each defines, and who imports it.

For the layout tests: that product modules are there for the product
(``tests/layout/test_importers.py``) and that the names a document cites exist
(``tests/layout/test_doc_references.py``). Everything is read with ``ast``, so a module
that needs torch, or fails to import, is read like any other.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

#: The one thread every ``parse`` runs on, started at the first and kept for the process.
_PARSER = ThreadPoolExecutor(1, thread_name_prefix="pdd-ast-parse")


def parse(source: str) -> ast.Module:
    """``ast.parse`` off the calling thread. Under pytest-xdist, after other tests in the
    same worker, CPython 3.11.7's AST constructor once raised SystemError ("AST constructor
    recursion depth mismatch", its count against the calling thread's recursion counter;
    not reproduced alone). The parser thread runs nothing but ``ast.parse``, so its counter
    is as clean as a new thread's; one thread for the process, not one per file (a tree
    read parses hundreds)."""
    return _PARSER.submit(ast.parse, source).result()


#: Folders setup.py maps whose code is not the product's.
NOT_PRODUCT = frozenset({"bench", "testing"})
MODULE_NAME = re.compile(r"pdd(?:\.\w+)+")


@dataclass(frozen=True)
class SourceTree:
    """Where each module of the ``pdd`` namespace lives, and which of them are product."""

    root: Path
    modules: Mapping[str, Path]
    product: frozenset[str]
    _names: dict[str, dict[str, set[str]]] = field(default_factory=dict, compare=False)

    def names(self, module: str) -> dict[str, set[str]]:
        """The names ``module`` defines at its top level (functions, classes, assignments,
        imports), each with the names defined in its body (a class's methods, attributes
        and nested classes; empty for others)."""
        if module not in self._names:
            self._names[module] = _defined(parse(self.modules[module].read_text()))
        return self._names[module]


def component_roots(root: Path) -> tuple[str, ...]:
    """setup.py's ``COMPONENT_ROOTS``, read without running setup()."""
    for node in ast.walk(parse((root / "setup.py").read_text())):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "COMPONENT_ROOTS" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise ValueError(f"{root / 'setup.py'} has no COMPONENT_ROOTS")


def read_tree(root: Path) -> SourceTree:
    """The tree setup.py maps: each folder of ``COMPONENT_ROOTS``, and ``cli/``."""
    modules: dict[str, Path] = {}
    product: set[str] = set()
    for folder in (*component_roots(root), "cli"):
        for path in sorted((root / folder / "pdd").rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            modules[name] = path
            if folder not in NOT_PRODUCT:
                product.add(name)
    return SourceTree(root, modules, frozenset(product))


def _defined(tree: ast.Module) -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for node in tree.body:
        for name in _bound(node):
            names.setdefault(name, set())
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n for child in node.body for n in _bound(child)}
    return names


def _bound(node: ast.stmt) -> list[str]:
    """The names a top-level or class-body statement binds."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    if isinstance(node, ast.If | ast.Try):
        return [n for child in node.body for n in _bound(child)]
    return []


def named_modules(source: str, path: Path, own: str | None) -> set[str]:
    """Every dotted name ``source`` imports, or names exactly as a string (``pdd.x.y``
    or ``pdd.x.y:attr``: a command table, a ``python -m`` line, an entry point)."""
    names: set[str] = set()
    for node in ast.walk(parse(source)):
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


def module_of(name: str, modules: Iterable[str]) -> tuple[str, list[str]] | None:
    """The longest module ``name`` starts with, and the attribute path after it."""
    known = set(modules)
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end]), parts[end:]
    return None


def importers(tree: SourceTree) -> dict[str, set[str]]:
    """module -> who imports it: a module name; ``tests/...``, ``bench/...`` and the like
    for files outside the namespace; ``build:...`` for the packaging's own (the console
    script in pyproject.toml, the Dockerfiles' commands). Importing a module imports the
    packages above it too."""
    found: dict[str, set[str]] = {name: set() for name in tree.modules}

    def add(who: str, names: Iterable[str]) -> None:
        for name in names:
            hit = module_of(name, tree.modules)
            if hit is None:
                continue
            parts = hit[0].split(".")
            for end in range(1, len(parts) + 1):
                module = ".".join(parts[:end])
                if module in found and module != who:
                    found[module].add(who)

    for name, path in tree.modules.items():
        add(name, named_modules(path.read_text(), path, name))
    for folder in ("tests", "bench", "e2e", "scripts"):
        for path in sorted((tree.root / folder).rglob("*.py")):
            if path.relative_to(tree.root / folder).parts[0] != "pdd":
                add(str(path.relative_to(tree.root)), named_modules(path.read_text(), path, None))
    for path in [tree.root / "pyproject.toml", *sorted((tree.root / "docker").glob("*Dockerfile"))]:
        if path.exists():
            add(f"build:{path.name}", MODULE_NAME.findall(path.read_text()))
    return found


def only_tests_import(tree: SourceTree) -> dict[str, set[str]]:
    """Product modules that nothing of the product imports, with who does."""
    return {
        module: who
        for module, who in sorted(importers(tree).items())
        if module in tree.product
        and not any(w in tree.product or w.startswith("build:") for w in who)
    }


COMMON = "pdd.common"


def common_consumers(tree: SourceTree) -> dict[str, set[str]]:
    """Each ``pdd.common`` module -> the product packages that use it (``pdd.router``, ...):
    those that import it, or import a ``pdd.common`` module that does. The benchmarks and
    the test harness sit above every product and may import any, so they make no module
    shared: what only they and one product use lives in that product."""
    found = importers(tree)
    common = [m for m in tree.modules if m.startswith(COMMON + ".")]

    def consumers(module: str, seen: frozenset[str]) -> set[str]:
        out: set[str] = set()
        for who in found[module]:
            package = ".".join(who.split(".")[:2])
            if package == COMMON and who not in seen:
                out |= consumers(who, seen | {who})
            elif who in tree.product and package != COMMON:
                out.add(package)
        return out

    return {module: consumers(module, frozenset({module})) for module in sorted(common)}


#: What a document cites in backticks that can be checked against the tree:
CITED = re.compile(r"`([^`\n]+)`")
#: ... a module path, perhaps with a name in it and one of that name's members;
DOTTED = re.compile(r"pdd(?:\.\w+)+")
#: ... a class (or other capitalised name), perhaps with one of its members;
CLASS_MEMBER = re.compile(r"[A-Z]\w*(?:\.\w+)?")
#: ... a function or method by name, called: ``decide()``;
CALLED = re.compile(r"[a-z_]\w*\(\)")
#: ... a file or folder of the repository (HTTP paths start with a slash: not these).
REPO_PATH = re.compile(r"[\w.-]+/(?:[\w.*-]+/?)*")


def missing_citations(tree: SourceTree, text: str) -> list[str]:
    """The backticked citations in ``text`` that name nothing in ``tree``: module paths
    (``pdd.router.dispatcher``, ``pdd.router.dispatcher.Dispatcher.attempt``), classes
    and their members (``LinkView``, ``Dispatcher.attempt``), functions called by name
    (``decide()``) and repository paths (``bench/pdd/bench/``). Other spans (commands,
    flags, values, HTTP paths) are not code names and are not checked."""
    classes: dict[str, set[str]] = {}
    functions: set[str] = set()
    for module in tree.modules:
        for name, members in tree.names(module).items():
            if name[:1].isupper():
                classes.setdefault(name, set()).update(members)
            functions.add(name)
            functions.update(members)
    missing = []
    for span in dict.fromkeys(CITED.findall(text)):
        cited = span.removesuffix("()")
        if DOTTED.fullmatch(cited):
            ok = _dotted_exists(tree, cited)
        elif CLASS_MEMBER.fullmatch(cited):
            name, _, member = cited.partition(".")
            ok = name in classes and (not member or member in classes[name])
        elif CALLED.fullmatch(span):
            ok = cited in functions
        elif REPO_PATH.fullmatch(span):
            ok = (
                any(tree.root.glob(span.rstrip("/")))
                if "*" in span
                else (tree.root / span).exists()
            )
        else:
            continue
        if not ok:
            missing.append(span)
    return missing


def _dotted_exists(tree: SourceTree, dotted: str) -> bool:
    hit = module_of(dotted, tree.modules)
    if hit is None:
        return False
    module, attrs = hit
    names = tree.names(module)
    if not attrs:
        return True
    if attrs[0] not in names:
        return False
    return len(attrs) == 1 or attrs[1] in names[attrs[0]]
