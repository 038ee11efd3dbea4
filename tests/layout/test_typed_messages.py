"""No message crosses a process boundary untyped (issue 57): every model a process sends
another is typed to its leaves, and every HTTP route between PDD's processes answers a
model. The exceptions are listed here, each with its reason; a new one fails the test
until it is typed or listed.

Checked: the pydantic models of the modules that define what crosses between processes
(router <-> worker, P <-> RLD <-> MD, operator -> pods, the WAN emulator's admin API, the
OpenAI API), no field typed ``Any`` at any depth; and the routes of the worker's control
API and the router's app (read from their source), no answer typed ``dict`` or ``Any``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from pdd.testing.source_tree import parse

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

#: Where the messages between processes are defined.
MESSAGE_MODULES = (
    "pdd.common.wire",
    "pdd.common.cache_events",
    "pdd.common.config_document",
    "pdd.worker.roles.protocol",
    "pdd.worker.transport.payloads",
    "pdd.wan.admin",
    "pdd.wan.stats",
    "pdd.router.openai_protocol",
)

#: Fields typed ``Any`` on purpose, and why.
ANY_FIELDS = {
    "pdd.router.openai_protocol.FunctionDefinition.parameters":
        "a tool's JSON Schema: any JSON object, by OpenAI's definition",
    "pdd.router.openai_protocol.JsonSchemaFormat.schema_":
        "response_format's JSON Schema: any JSON object, by OpenAI's definition",
    "pdd.router.openai_protocol.ChatMessage.content":
        "content parts: OpenAI's list of typed parts, checked part by part where read "
        "(text parts only; others refused with the part named)",
    "pdd.router.openai_protocol.ChatCompletionRequest.chat_template_kwargs":
        "passed to the model's own chat template, whose variables are the model's",
}  # fmt: skip

#: The HTTP APIs between PDD's processes, and the routes that answer no model, and why.
HTTP_APIS = ("worker/pdd/worker/control_api.py", "router/pdd/router/app.py")
UNTYPED_ROUTES = {
    ("router/pdd/router/app.py", "/health"): "a probe: its status code is the answer",
    ("router/pdd/router/app.py", "/startup"): "Kubernetes' probe: its status code is the answer",
    ("router/pdd/router/app.py", "/live"): "Kubernetes' probe: its status code is the answer",
    ("worker/pdd/worker/control_api.py", "/startup"):
        "Kubernetes' probe: its status code is the answer",
}  # fmt: skip


def any_typed(annotation: object) -> bool:
    if annotation is typing.Any:
        return True
    return any(any_typed(arg) for arg in typing.get_args(annotation))


def any_fields() -> set[str]:
    found = set()
    for name in MESSAGE_MODULES:
        module = importlib.import_module(name)
        for cls_name, cls in vars(module).items():
            if not (inspect.isclass(cls) and issubclass(cls, BaseModel)):
                continue
            if cls.__module__ != name:
                continue
            for field, info in cls.model_fields.items():
                if any_typed(info.annotation):
                    found.add(f"{name}.{cls_name}.{field}")
    return found


def test_no_message_field_is_typed_any_but_those_listed_with_a_reason() -> None:
    assert any_fields() == set(ANY_FIELDS)


def route_path(decorator: ast.expr) -> str | None:
    """The path of an ``@app.<method>(path, ...)`` decorator; None for any other."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
        return None
    owner, first = decorator.func.value, decorator.args[0] if decorator.args else None
    if not (isinstance(owner, ast.Name) and owner.id == "app"):
        return None
    return str(first.value) if isinstance(first, ast.Constant) else None


def untyped_routes(source: str) -> set[str]:
    """The paths of ``@app.<method>(path)`` routes whose answer is typed ``dict``/``Any``."""
    found = set()
    for node in ast.walk(parse(source)):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        returns = ast.unparse(node.returns) if node.returns is not None else "Any"
        if returns.split("[")[0] not in {"dict", "Any", "typing.Any"}:
            continue
        found |= {p for d in node.decorator_list if (p := route_path(d)) is not None}
    return found


def test_every_route_between_processes_answers_a_model_but_probes() -> None:
    found = {(api, p) for api in HTTP_APIS for p in untyped_routes((ROOT / api).read_text())}
    assert found == set(UNTYPED_ROUTES)


def test_the_route_check_sees_an_untyped_answer() -> None:
    source = '@app.get("/x")\nasync def x() -> dict:\n    return {}\n'
    assert untyped_routes(source) == {"/x"}
