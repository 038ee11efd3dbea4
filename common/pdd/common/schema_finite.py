"""Whether a JSON Schema admits any finite value: the check llguidance leaves out.

llguidance refuses a schema nothing satisfies directly (``false``, an empty ``enum``), but
not one whose every value must contain another value of itself: an object whose required
property refers back to it, an array of at least one such item, a branch of ``allOf``.
Its grammar compiles, yet no output can ever end: llguidance forces an endless prefix
(``{"c":{"c":...``) and gives up on it after the first token, or the model writes until
``max_tokens``. Such a schema is the client's mistake, so it is a 400 before any worker
sees it.

A schema is read as AND/OR nodes over its subschemas (a ``$ref``, every ``allOf``
member, one of the ``anyOf``/``oneOf`` members, one of the allowed types: for an object
every required property, for an array its first ``minItems`` items) and a node is
satisfiable once enough of its children are (least fixpoint, one pass over the edges).
It errs on the side of "satisfiable": keywords it does not read (``not``, ``if``,
``contains``, remote or ``$id`` references, ``patternProperties``) never make a
schema unsatisfiable here; llguidance judges those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

#: The types whose values may have to contain others; a value of any other type exists
#: whatever else the schema says of it here.
_NESTED = ("object", "array")


@dataclass
class _Node:
    any_of: bool  # OR: one child satisfiable is enough; AND: every child must be
    children: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    waiting: int = 0  # AND: children not yet known satisfiable (counted per edge)


class _Graph:
    """The AND/OR nodes of one schema; schema dicts (and booleans) are nodes by identity."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.nodes: list[_Node] = []
        self._ids: dict[int, int] = {}
        self._keep: list[Any] = []  # the schemas whose id() keys ``_ids``
        self._todo: list[tuple[Any, int]] = []
        #: The ``$ref`` strings met, with the node of what each names.
        self.refs: list[tuple[str, int]] = []

    def build(self) -> int:
        root = self.schema_node(self.root)
        while self._todo:
            schema, node = self._todo.pop()
            self._expand(schema, node)
        return root

    def schema_node(self, schema: Any) -> int:
        """The AND node of ``schema``, built (its children) later, without recursion."""
        key = id(schema)
        if key not in self._ids:
            self._ids[key] = node = self._new(any_of=False)
            self._keep.append(schema)
            if isinstance(schema, dict):
                self._todo.append((schema, node))
            elif schema is False:
                self._edge(node, self._new(any_of=True))  # an OR of nothing: never satisfied
        return self._ids[key]

    def _new(self, any_of: bool) -> int:
        self.nodes.append(_Node(any_of))
        return len(self.nodes) - 1

    def _edge(self, parent: int, child: int) -> None:
        self.nodes[parent].children.append(child)
        self.nodes[child].parents.append(parent)

    def _expand(self, schema: dict[str, Any], node: int) -> None:
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = _resolve(self.root, ref)
            if target is not None:
                self._edge(node, self.schema_node(target))
                self.refs.append((ref, self.schema_node(target)))
        for member in _schemas(schema.get("allOf")):
            self._edge(node, self.schema_node(member))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                self._edge(node, self._choice([self.schema_node(m) for m in schema[key]]))
        if "const" not in schema and "enum" not in schema:  # a literal value needs no type
            self._edge(node, self._choice(self._types(schema)))

    def _choice(self, options: list[int]) -> int:
        choice = self._new(any_of=True)
        for option in options:
            self._edge(choice, option)
        return choice

    def _types(self, schema: dict[str, Any]) -> list[int]:
        """One AND node per type ``schema`` allows (all, where it names none)."""
        named = schema.get("type", "any")
        types = [named] if isinstance(named, str) else named
        if not isinstance(types, list) or not types or any(t not in _NESTED for t in types):
            return [self._new(any_of=False)]  # a leaf value (or a type llguidance refuses)
        needs = {"object": _object_needs(schema), "array": _array_needs(schema)}
        nodes = []
        for kind, children in needs.items():
            if kind in types:
                each = self._new(any_of=False)
                for child in children:
                    self._edge(each, self.schema_node(child))
                nodes.append(each)
        return nodes


def _object_needs(schema: dict[str, Any]) -> list[Any]:
    """The schemas of the required properties it declares (others may be anything)."""
    properties, required = schema.get("properties"), schema.get("required")
    if not isinstance(properties, dict) or not isinstance(required, list):
        return []
    return [properties[n] for n in required if isinstance(n, str) and n in properties]


def _array_needs(schema: dict[str, Any]) -> list[Any]:
    """The schemas of the first ``minItems`` items."""
    count = schema.get("minItems", 0)
    if not isinstance(count, int) or count <= 0:
        return []
    prefix = schema.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    items = schema.get("items")
    tail = [items] if count > len(prefix) and isinstance(items, dict | bool) else []
    return prefix[:count] + tail


def endless_reference(schema: Any) -> str | None:
    """None where ``schema`` admits a finite value; else the ``$ref`` whose every value
    would have to contain another (or ``"#"``, the schema itself, where no reference is
    to blame)."""
    graph = _Graph(schema)
    root = graph.build()
    satisfiable = _satisfiable(graph.nodes)
    if satisfiable[root]:
        return None
    return next((ref for ref, node in graph.refs if not satisfiable[node]), "#")


def _satisfiable(nodes: list[_Node]) -> list[bool]:
    """Each node's verdict: propagate from the nodes that need nothing, one edge at a
    time (every edge is followed at most once)."""
    done = [False] * len(nodes)
    ready = []
    for i, node in enumerate(nodes):
        node.waiting = len(node.children)
        if not node.any_of and not node.children:
            ready.append(i)
    while ready:
        i = ready.pop()
        if done[i]:
            continue
        done[i] = True
        for parent in nodes[i].parents:
            p = nodes[parent]
            p.waiting -= 1
            if not done[parent] and (p.any_of or p.waiting == 0):
                ready.append(parent)
    return done


def _schemas(value: Any) -> list[Any]:
    return [v for v in value if isinstance(v, dict | bool)] if isinstance(value, list) else []


def _resolve(root: Any, ref: str) -> Any:
    """What a local reference (``#``, ``#/$defs/x``) names in ``root``; None for any
    other (llguidance refuses those it cannot resolve)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | bool) else None
