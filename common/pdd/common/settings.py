"""Settings tables: each component's settings declared once, with their help and defaults.

A component's settings are the fields of one pydantic model that carry descriptions:
the router's ``RouterConfig`` (fields made with ``setting``), the engine's
``EngineSettings`` and the WAN's ``WanKVSettings`` (sections of the config document and
of the CRD, so the CRD's field, the document's and the flag are one declaration).
``add_settings`` turns such a table into argparse flags (``--name-with-dashes``, the
names vLLM uses for the same meaning accepted as aliases), and docs/configuration.md's
tables are generated from the resulting parsers, so a setting has one name from the CRD
to the engine and its help, default and aliases are written in one place.

``HelpFormatter`` is what every ``pdd`` command's parser uses: it shows each flag's
default in ``--help``.
"""

from __future__ import annotations

import argparse
import copy
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Setting:
    """One setting: its name (the model's field), help and default.

    ``aliases`` are other flag spellings accepted for the same meaning (vLLM's names);
    ``default_text`` says what an unset (None) default means, e.g. "the checkpoint's";
    ``flag_name``: the flag's name and argparse ``dest`` where they are not the field's (the
    WAN line's ``gbps`` is ``--link-gbps`` among a command's other flags); ``required``:
    the command takes no default for it.
    """

    name: str
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    default_text: str | None = None
    action: str | None = None
    #: The config document / CRD field it is read from, where there is one.
    field: str | None = None
    flag_name: str | None = None
    required: bool = False

    @property
    def dest(self) -> str:
        """The argparse ``dest`` of its flag."""
        return self.flag_name or self.name

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases)


@dataclass(frozen=True)
class DocumentField:
    """Where a model's field is read from in the config document: a dotted camelCase path of
    its wire form, and the conversion where the document writes the value in another unit
    or form (milliseconds for seconds, the CRD's policy name for the flag's). Kept in the
    pydantic field's metadata (``setting``, ``from_document``), read by ``read_document``."""

    path: str
    convert: Callable[[Any], Any] | None = None

    def read(self, document: dict[str, Any]) -> Any:
        """The field's value in ``document`` (a ``None`` is not converted)."""
        value = config_value(document, self.path)
        return value if self.convert is None or value is None else self.convert(value)


def setting(
    default: Any = None,
    help: str = "",
    *,
    default_factory: Callable[[], Any] | None = None,
    aliases: Sequence[str] = (),
    metavar: str | None = None,
    default_text: str | None = None,
    field: str | None = None,
    convert: Callable[[Any], Any] | None = None,
    flag: str | None = None,
) -> Any:
    """A pydantic field that is a setting (a flag and a docs row) of a model with no config
    document of its own (the router's ``RouterConfig``): its help is the description.

    ``field``: the config document's field (a dotted camelCase path, ``wan.declaredGbps``)
    the setting is read from where the operator renders one (``read_document``), its value
    passed through ``convert`` where the document's unit or form differs. ``flag``: the
    flag's name (and ``dest``, underscored) where it is not the field's."""
    extra = {
        "flagAliases": list(aliases) or None,
        "flagMetavar": metavar,
        "defaultText": default_text,
        "configField": field,
        "flagName": flag,
    }
    schema_extra: dict[str, Any] = {k: v for k, v in extra.items() if v is not None}
    if default_factory is not None:
        info = Field(
            default_factory=default_factory, description=help, json_schema_extra=schema_extra
        )
    else:
        info = Field(default, description=help, json_schema_extra=schema_extra)
    if field is not None:
        info.metadata.append(DocumentField(field, convert))
    return info


def from_document(default: Any, field: str, convert: Callable[[Any], Any] | None = None) -> Any:
    """A pydantic field that is no flag but is read from the config document's ``field``
    (through ``convert``, as ``setting``'s): e.g. a value the operator alone sets."""
    info = Field(default)
    info.metadata.append(DocumentField(field, convert))
    return info


#: ``same_setting``'s "no default of its own" (None is a default).
_SAME_DEFAULT: Any = object()


def same_setting(info: FieldInfo, *, field: str | None = None, default: Any = _SAME_DEFAULT) -> Any:
    """Another model's field as a field of this one: the same setting (its help, defaults,
    aliases and bounds, declared once there), e.g. an ``EngineSettings`` field among the
    worker's options; ``field``: where this model reads it from the config document;
    ``default``: this component's own default where it assumes another (the router's
    declared line rate where a setting has none)."""
    same = copy.deepcopy(info)
    if default is not _SAME_DEFAULT:
        same.default = default
    if field is not None:
        extra = same.json_schema_extra if isinstance(same.json_schema_extra, dict) else {}
        same.json_schema_extra = {**extra, "configField": field}
        same.metadata.append(DocumentField(field))
    return same


def document_fields(cls: type[BaseModel]) -> dict[str, DocumentField]:
    """The fields of ``cls`` read from the config document, each with where and how."""
    return {
        name: marks[0]
        for name, info in cls.model_fields.items()
        if (marks := [m for m in info.metadata if isinstance(m, DocumentField)])
    }


def read_document(cls: type[BaseModel], document: dict[str, Any]) -> dict[str, Any]:
    """The values of ``cls``' document fields (``document_fields``) in ``document``'s wire
    form, by field name, converted to the field's unit and form."""
    return {name: field.read(document) for name, field in document_fields(cls).items()}


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (it, False)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _parse_kind(annotation: Any) -> tuple[Callable[[str], Any] | None, tuple[Any, ...] | None]:
    """(argparse type, choices) for a field's annotation."""
    kind, _ = _unwrap(annotation)
    if typing.get_origin(kind) is Literal:
        return None, tuple(typing.get_args(kind))
    if isinstance(kind, type) and issubclass(kind, Enum):
        return kind, tuple(kind)
    if kind in (int, float, Path):
        return kind, None
    return None, None


def settings_of(cls: type[BaseModel]) -> list[Setting]:
    """The settings table of a pydantic model: every field with a description (the help).

    The default is the field's own; ``json_schema_extra`` adds the flag's parts:
    ``{"flagAliases": [...], "flagDefault": X, "defaultText": S}`` (``flagDefault`` where
    the field has none, as the engine's settings leave an unset field to the worker),
    ``"flagMetavar": M`` where the flag takes more than the field's choices,
    ``"configField": PATH`` where the document's field is not the model's own alias, and
    ``"flagName": NAME`` where the flag is named apart from the field. A bool is a switch
    (``store_true``)."""
    hints = typing.get_type_hints(cls)
    table: list[Setting] = []
    for name, info in cls.model_fields.items():
        if not info.description:
            continue
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        parse, choices = _parse_kind(hints[name])
        metavar = typing.cast(str | None, extra.get("flagMetavar"))
        is_bool = _unwrap(hints[name])[0] is bool
        table.append(
            Setting(
                name=name,
                help=info.description,
                default=extra.get("flagDefault", _field_default(info)),
                type=None if is_bool else parse,
                choices=None if metavar else choices,
                metavar=metavar,
                aliases=tuple(typing.cast(list[str], extra.get("flagAliases", []))),
                default_text=typing.cast(str | None, extra.get("defaultText")),
                action="store_true" if is_bool else None,
                field=typing.cast(str | None, extra.get("configField")) or info.alias,
                flag_name=typing.cast(str | None, extra.get("flagName")),
            )
        )
    return table


def _field_default(info: FieldInfo) -> Any:
    """A pydantic field's own default (None where it has none, or only a factory)."""
    return None if info.is_required() or info.default_factory else info.default


def add_settings(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    table: Iterable[Setting],
    *,
    only: Iterable[str] | None = None,
    flag_defaults: bool = True,
) -> None:
    """Add a flag per setting of ``table`` (those named in ``only``, if given).

    ``flag_defaults``: the flags default to the table's defaults; False leaves them None
    (so a caller sees which were given, e.g. to let them override a config file), while
    ``--help`` still shows the table's default.
    """
    wanted = None if only is None else set(only)
    for s in table:
        if wanted is not None and s.name not in wanted:
            continue
        kwargs: dict[str, Any] = {"dest": s.dest, "help": _help(s)}
        if s.required:
            kwargs["required"] = True
        if s.action == "store_true":
            kwargs["action"] = "store_true"
            kwargs["default"] = s.default if flag_defaults else None
        else:
            kwargs["default"] = s.default if flag_defaults else None
            if s.type is not None:
                kwargs["type"] = s.type
            if s.choices is not None:
                kwargs["choices"] = s.choices
            if s.metavar is not None:
                kwargs["metavar"] = s.metavar
        parser.add_argument(*s.flags, **kwargs)


def flag_values(table: Iterable[Setting], args: argparse.Namespace) -> dict[str, Any]:
    """The values of the flags ``add_settings`` made of ``table``, by field name (a flag the
    parser lacks, or that was left None, is left out: the field's default, or the config
    document's value, holds)."""
    return {s.name: value for s in table if (value := getattr(args, s.dest, None)) is not None}


def _help(s: Setting) -> str:
    """The help line with its default, written once here (``HelpFormatter`` adds none)."""
    if s.action == "store_true":
        return s.help
    if s.required:
        return f"{s.help} (required)"
    if s.default is not None:
        shown = s.default.value if isinstance(s.default, Enum) else s.default
        return f"{s.help} (default: {shown})"
    if s.default_text:
        return f"{s.help} (default: {s.default_text})"
    return s.help


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default (unless its help already says it), choices included."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS, []):
            return text
        if action.option_strings and action.nargs != 0:
            return text + " (default: %(default)s)"
        return text


def parser(prog: str, description: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """An argparse parser for a ``pdd`` command, with defaults shown in ``--help`` (and
    the description's reStructuredText quotes dropped: it is read in a terminal)."""
    text = None if description is None else description.replace("``", "")
    return argparse.ArgumentParser(
        prog=prog, description=text, formatter_class=HelpFormatter, **kwargs
    )


def flag_table(p: argparse.ArgumentParser) -> str:
    """A Markdown table of ``p``'s flags and arguments: what docs/configuration.md shows."""
    formatter = p._get_formatter()
    rows = ["| Flag | Meaning |", "|---|---|"]
    for action in p._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            names = ", ".join(f"`{name}`" for name in action.choices)
            rows.append(f"| {names} | {action.help or 'verbs'} |")
            continue
        name = " / ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest.upper()}`"
        text = formatter._expand_help(action).replace("|", "\\|")
        rows.append(f"| {name} | {text} |")
    return "\n".join(rows) + "\n"


def config_value(document: dict[str, Any], path: str) -> Any:
    """The value at a dotted path of a config document's wire form (``wan.declaredGbps``)."""
    value: Any = document
    for part in path.split("."):
        value = value[part]
    return value


def settings_table(table: Iterable[Setting], field_prefix: str) -> str:
    """A Markdown table of settings with their config-document / CRD fields and aliases
    (a setting read from no field shows none)."""
    rows = [
        "| Flag | Field | Also accepted | Default | Meaning |",
        "|---|---|---|---|---|",
    ]
    for s in table:
        default = s.default if s.default is not None else (s.default_text or "unset")
        aliases = ", ".join(f"`{a}`" for a in s.aliases) or ""
        rows.append(
            f"| `{s.flag}` | {f'`{field_prefix}{s.field}`' if s.field else ''} | {aliases} "
            f"| {default} "
            f"| {s.help} |"
        )
    return "\n".join(rows) + "\n"
