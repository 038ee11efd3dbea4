"""A pydantic model as a Kubernetes structural schema (OpenAPI v3, as a CRD needs it).

pydantic's JSON schema carries the types, bounds, enums, patterns, descriptions (the
fields' docstrings) and the ``json_schema_extra`` of each model; this module turns it into
what the API server accepts and applies: every ``$ref`` inlined (a structural schema has
none), ``X | None`` as a plain optional ``X`` (Kubernetes prunes a null, then defaults),
``exclusiveMinimum`` in OpenAPI 3.0's boolean form, an int-or-string quantity as
``x-kubernetes-int-or-string``, and each field's default as the API server applies it.
Anything else a schema could say is refused, so that no keyword reaches the CRD unread.
"""

from __future__ import annotations

import copy
import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pdd.operator.cel import placed

#: Keywords copied as they are (the structural subset the models use).
_PLAIN = {
    "type", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern", "format",
    "minItems", "maxItems", "description",
}  # fmt: skip
#: ``json_schema_extra`` keys of the engine settings that describe a flag (pdd.common.settings):
#: the default they name goes into the description, the rest is the CLI's.
_FLAG_KEYS = {"flagDefault", "flagAliases", "flagMetavar", "defaultText"}
#: pydantic's keywords a CRD does without: titles, and the defaults it writes (they are
#: computed from the fields instead, default factories included).
_DROPPED = {"title", "default", "additionalProperties", "required", "properties", "$ref"}


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model`` as a structural schema, descriptions, defaults and CEL rules included."""
    raw = model.model_json_schema(by_alias=True)
    definitions = raw.pop("$defs", {})
    return _Converter(definitions, _models(model)).model(model, raw, "")


class _Converter:
    def __init__(self, definitions: dict[str, Any], models: dict[str, type[BaseModel]]) -> None:
        self.definitions = definitions
        self.models = models

    def model(self, model: type[BaseModel], raw: dict[str, Any], path: str) -> dict[str, Any]:
        """An object: its fields' schemas, required list, and its own rules and text."""
        out: dict[str, Any] = {"type": "object"}
        if raw.get("description"):
            out["description"] = _sentence(raw["description"])
        properties = {}
        for name, field in model.model_fields.items():
            alias = field.alias or name
            where = f"{path}.{alias}" if path else alias
            properties[alias] = self.field(field, raw["properties"][alias], where)
        out["properties"] = properties
        required = [f.alias or n for n, f in model.model_fields.items() if f.is_required()]
        if required:
            out["required"] = required
        _extensions(out, raw, path)
        return out

    def field(self, field: FieldInfo, raw: dict[str, Any], path: str) -> dict[str, Any]:
        """A property: its type's schema, its own description over its type's, its default."""
        out = self.node(raw, path)
        description = _description(raw)
        if description:
            out["description"] = description
        default = _default(field, out)
        if default is not _NONE:
            out["default"] = default
        return out

    def node(self, raw: dict[str, Any], path: str) -> dict[str, Any]:
        """One schema node of any shape (a reference, an optional, a container, a scalar)."""
        if "$ref" in raw:
            name = raw["$ref"].rsplit("/", 1)[-1]
            return self.model(self.models[name], self.definitions[name], path)
        if "anyOf" in raw:
            return self.union(raw, path)
        if "type" not in raw:
            raise ValueError(f"{path}: no type (a structural schema types every field)")
        return self.keywords(raw, path)

    def keywords(self, raw: dict[str, Any], path: str) -> dict[str, Any]:
        """A typed node's keywords, in OpenAPI 3.0's spelling; an unknown one is an error."""
        unknown = set(raw) - _PLAIN - _FLAG_KEYS - _DROPPED - {"items", "exclusiveMinimum"}
        unknown -= {key for key in raw if key.startswith("x-kubernetes-")}
        if unknown:
            raise ValueError(f"{path}: no CRD form for schema keywords {sorted(unknown)}")
        # Copies: pydantic shares one $defs entry among its uses, the CRD spells each out.
        out = {k: copy.deepcopy(v) for k, v in raw.items() if k in _PLAIN - {"description"}}
        if "exclusiveMinimum" in raw and raw.get("type") == "integer":  # > n is >= n + 1
            out["minimum"] = raw["exclusiveMinimum"] + 1
        elif "exclusiveMinimum" in raw:  # JSON Schema's number -> OpenAPI 3.0's boolean
            out.update(minimum=raw["exclusiveMinimum"], exclusiveMinimum=True)
        if "items" in raw:
            out["items"] = self.node(raw["items"], f"{path}[]")
        if isinstance(raw.get("additionalProperties"), dict):
            out["additionalProperties"] = self.node(raw["additionalProperties"], f"{path}.*")
        _extensions(out, raw, path)
        return out

    def union(self, raw: dict[str, Any], path: str) -> dict[str, Any]:
        """``X | None`` is an optional X; ``int | str`` a Kubernetes int-or-string."""
        rest = {key: value for key, value in raw.items() if key not in ("anyOf", "default")}
        branches = [branch for branch in raw["anyOf"] if branch != {"type": "null"}]
        if len(branches) == 1:
            return self.node({**branches[0], **rest}, path)
        if sorted(branch.get("type", "") for branch in branches) == ["integer", "string"]:
            out: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
            out.update(self.keywords(rest, path))
            out["x-kubernetes-int-or-string"] = True
            return out
        raise ValueError(f"{path}: Kubernetes takes no union of {branches}")


_NONE = object()


def _default(field: FieldInfo, schema: dict[str, Any]) -> Any:
    """The default the API server should apply, or ``_NONE``: a model default as what differs
    from the model's own defaults (``{}`` where the object's fields carry defaults of their
    own, to be applied in turn), a non-empty container, or a plain value."""
    if field.is_required():
        return _NONE
    value = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
    if isinstance(value, BaseModel):
        dumped = value.model_dump(by_alias=True, exclude_defaults=True, mode="json")
        return dumped if dumped or _has_defaults(schema) else _NONE
    if value is None or (isinstance(value, (list, dict)) and not value):
        return _NONE
    return value


def _has_defaults(schema: dict[str, Any]) -> bool:
    return any("default" in prop for prop in schema.get("properties", {}).values())


def _description(raw: dict[str, Any]) -> str:
    """A field's text as a sentence, with the default a flag-backed setting names."""
    text = raw.get("description", "")
    if not text:
        return ""
    default = raw.get("defaultText", raw.get("flagDefault"))
    suffix = f" Default: {default}." if default is not None else ""
    return _sentence(text) + suffix


def _sentence(text: str) -> str:
    """One line ending in a full stop, its first word capitalised where it is a plain word
    (CLI help starts lower case; ``spec.wan.rttMs`` or ``max_tokens`` stay as they are)."""
    flat = " ".join(text.split())
    if _PLAIN_WORD.match(flat):
        flat = flat[0].upper() + flat[1:]
    return flat if flat.endswith(".") else flat + "."


_PLAIN_WORD = re.compile(r"[a-z]+(?=[ ,:;'-])")


def _extensions(out: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    """The ``x-kubernetes-*`` keys of ``raw``; rules with their ``{path}`` filled in."""
    for key, value in raw.items():
        if key == "x-kubernetes-validations":
            out[key] = placed(value, path)
        elif key.startswith("x-kubernetes-"):
            out[key] = copy.deepcopy(value)


def _models(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model ``root`` holds, by the name pydantic's ``$defs`` give it."""
    found: dict[str, type[BaseModel]] = {}
    pending = [root]
    while pending:
        model = pending.pop()
        if found.setdefault(model.__name__, model) is not model:
            raise ValueError(f"two models named {model.__name__}: $defs would mix them up")
        for field in model.model_fields.values():
            pending += [m for m in _inner_models(field.annotation) if m.__name__ not in found]
    return found


def _inner_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        return [m for arg in typing.get_args(annotation) for m in _inner_models(arg)]
    return []
