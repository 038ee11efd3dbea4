"""Chat templates rendered the way Hugging Face renders them, without transformers.

The router must produce the *exact* prompt string the model was trained on, or the
token IDs (and so the prefix-cache block hashes) drift from what a client of the same
checkpoint would get. So the environment copies ``transformers``' chat-template
environment: a sandbox (templates from the Hub are untrusted code), trim_blocks and
lstrip_blocks, ``raise_exception``, a ``tojson`` that does not HTML-escape,
``strftime_now``, loop controls, the ``{% generation %}`` tag, and the tokenizer's
special tokens as variables. Messages lose their None-valued keys first, as in
transformers, because templates test ``'key' in message``.

A template is code run on the client's data: whatever it raises while rendering one
conversation (a ``raise_exception``, a type error on a value from ``chat_template_kwargs``)
is that request's 400, never the server's 500. ``chat_template_kwargs`` may set any
variable but those in ``RESERVED_KWARGS`` (``check_template_kwargs``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: Special-token names transformers passes to a template (``special_tokens_map``).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """A template refused the conversation (``raise_exception``) or is broken; a 400."""


class ReservedKwargError(ChatTemplateError):
    """``chat_template_kwargs`` names a variable the request may not set (``key``)."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"chat_template_kwargs may not set {key!r}: the router or the template's "
            "environment defines it "
            f"(reserved: {', '.join(sorted(RESERVED_KWARGS))})"
        )
        self.key = key


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training
    masks; for serving it renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares tags as an instance attribute)

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


#: What ``chat_template_kwargs`` may not set: the arguments the router passes itself (a
#: key among them was a TypeError, a 500), the template (not swapped per request), and
#: the environment's functions (``raise_exception``, ``strftime_now``, jinja's
#: ``range``, ``namespace`` ...), which a value would shadow in every template that
#: calls them. Special tokens may be set, as transformers lets them be.
RESERVED_KWARGS = frozenset(
    ("messages", "tools", "documents", "add_generation_prompt", "chat_template",
     *_environment().globals)
)  # fmt: skip


def check_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """``ReservedKwargError`` for the first key of ``kwargs`` the request may not set."""
    for key in kwargs:
        if key in RESERVED_KWARGS:
            raise ReservedKwargError(key)


class ChatTemplate:
    """A compiled chat template plus the special tokens it may reference."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt string; ``kwargs`` (``chat_template_kwargs``, checked with
        ``check_template_kwargs``) override special tokens."""
        cleaned = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=cleaned,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the conversation: {exc}") from exc
        except (TypeError, ValueError, LookupError, ArithmeticError) as exc:
            raise ChatTemplateError(
                f"chat template failed on this conversation: {type(exc).__name__}: {exc}"
            ) from exc


#: How the plain fallback teaches a model to call a tool: the Hermes convention, so the
#: router reads its calls with the Hermes parser (``tool_calls.detect_format``).
PLAIN_TOOL_INSTRUCTION = (
    'To call a tool, write <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>'
)


def render_plain(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The fallback when a checkpoint has no template: ``role: content`` lines, after a
    ``tools:`` line (the tools as JSON, and ``PLAIN_TOOL_INSTRUCTION``) when tools are given."""
    lines = [f"{m['role']}: {_plain_text(m.get('content'))}\n" for m in messages]
    if tools:
        lines.insert(0, f"tools: {_tojson(tools)}\n{PLAIN_TOOL_INSTRUCTION}\n")
    if add_generation_prompt:
        lines.append("assistant:")
    return "".join(lines)


def _plain_text(content: str | None) -> str:
    """A message's content, already text (``ChatMessage.text``), or none."""
    return content or ""


def special_tokens_from_config(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """Special-token strings from ``tokenizer_config.json`` (plain or AddedToken dicts)."""
    tokens: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def find_chat_template(
    model_dir: Path, tokenizer_config: Mapping[str, Any], with_tools: bool = False
) -> str | None:
    """The checkpoint's template source, looked up where transformers saves it.

    ``chat_template.jinja`` (transformers >= 4.50 writes it beside the config) wins,
    then ``chat_template.json``, then the ``chat_template`` key of tokenizer_config.
    A list of named templates picks ``tool_use`` when tools are given, else ``default``.
    """
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        template = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
    else:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        if with_tools and "tool_use" in named:
            return named["tool_use"]
        return named.get("default")
    return template
