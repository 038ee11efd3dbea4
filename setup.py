"""Package discovery for the one `pdd` namespace spread over the component folders.

`pdd` is an implicit namespace package (no __init__.py at that level) whose
subpackages live in a folder each: common/pdd/common, worker/pdd/worker,
router/pdd/router, operator/pdd/operator, simulator/pdd/simulator, local/pdd/local
(`pdd up`), wan/pdd/wan (`pdd wan-link`), bench/pdd/bench (`pdd bench`, beside the
benchmark scripts in bench/) and testing/pdd/testing (the test harness). The one
module at the top, `pdd.cli` (the `pdd` command every image runs), lives in cli/pdd.
setuptools' declarative `find` cannot map several roots into one namespace, so each
package is mapped to its folder here. No folder name can shadow the standard library:
the operator is pdd.operator.
"""

from setuptools import find_namespace_packages, setup

COMPONENT_ROOTS = (
    "common", "worker", "router", "operator", "simulator", "local", "wan", "bench", "testing",
)

packages: list[str] = []
package_dir: dict[str, str] = {}
for root in COMPONENT_ROOTS:
    for package in find_namespace_packages(where=root, include=["pdd.*"]):
        if "__pycache__" in package:
            continue
        packages.append(package)
        package_dir[package] = f"{root}/{package.replace('.', '/')}"
packages.append("pdd")
package_dir["pdd"] = "cli/pdd"

setup(packages=packages, package_dir=package_dir)
