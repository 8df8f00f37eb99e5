"""Comparing two JSON schemas of one member (an event's payload, an envelope): each
difference reported with the path of the field and whether it breaks a partner (see
``_diff`` for the rules)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from router.ops.contract._schema import Schema, canonical, resolve

__all__ = ["Report", "compare_schemas"]

# Called with: breaking, the field's path, what changed.
Report = Callable[[bool, str, str], None]

# Keywords that document a schema without constraining it.
_COSMETIC = frozenset({"title", "description", "examples", "default", "$comment", "deprecated"})
# Keywords read as a whole (a list of members, a structure): not bounds of a value.
_STRUCTURE = frozenset(
    {
        "type",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "properties",
        "required",
        "items",
        "additionalProperties",
        "$ref",
        "$defs",
        "prefixItems",
        "patternProperties",
    }
)


# A field required at a version must be in every message of that version: those already
# sent (and stored rows replayed) lack it, so a partner validating with the new schema fails.
_NEW_REQUIRED = (
    "new required field: messages already sent at this version lack it "
    "(make it optional, or add it in a new version)"
)

_NOW_DEFAULTED = "now has a default: a message may lack it (the router still writes it)"


@dataclass
class _Node:
    """One schema, flattened over its union members."""

    types: set[str] = field(default_factory=set)
    values: set[str] | None = None  # enum or const values (canonical JSON); None: any
    bounds: set[str] = field(default_factory=set)  # format, pattern, minimum, ... as "k=v"
    properties: dict[str, list[Schema]] = field(default_factory=dict)
    required: set[str] | None = None
    items: list[Schema] = field(default_factory=list)
    extra: list[Schema] = field(default_factory=list)


def compare_schemas(
    old: Schema, new: Schema, path: str, report: Report, *, old_lists_written: bool = False
) -> None:
    """Report each difference from ``old`` to ``new`` (two whole schemas, each holding the
    ``$defs`` its references point into) under ``path``. ``old_lists_written``: the old
    schema's ``required`` names every field written, defaults included (a payload in a lock
    of format 1), so a field it lists that now has a default is no change."""
    _Walk(report, old, new, old_lists_written).schema(old, new, path)


class _Walk:
    """Compares an old schema with a new one, each with the root its ``$ref`` point into."""

    def __init__(
        self, report: Report, old_root: Schema, new_root: Schema, old_lists_written: bool
    ) -> None:
        self.report, self.old_root, self.new_root = report, old_root, new_root
        self.old_lists_written = old_lists_written
        self.inside: set[tuple[str, str]] = set()  # the references being compared

    def schema(self, old: Schema, new: Schema, path: str) -> None:
        refs = (str(old.get("$ref")), str(new.get("$ref")))
        if "$ref" not in old or "$ref" not in new:
            self._compare(old, new, path)
        elif refs not in self.inside:  # else a recursive model, being compared further up
            self.inside.add(refs)
            try:
                self._compare(old, new, path)
            finally:
                self.inside.discard(refs)

    def _compare(self, old: Schema, new: Schema, path: str) -> None:
        a, b = _node(old, self.old_root), _node(new, self.new_root)
        self.types(a, b, path)
        self.values(a, b, path)
        if a.bounds != b.bounds:
            self.report(True, path, f"changed: {_list(a.bounds)} -> {_list(b.bounds)}")
        if "object" in a.types and "object" in b.types:
            self.properties(a, b, path)
        if "array" in a.types and "array" in b.types and a.items and b.items:
            self.schema(_union(a.items), _union(b.items), f"{path}[]")
        if a.extra and b.extra:
            self.schema(_union(a.extra), _union(b.extra), f"{path}{{}}")

    def types(self, a: _Node, b: _Node, path: str) -> None:
        if a.types == b.types:
            return
        change = f"{_list(a.types)} -> {_list(b.types)}"
        if a.types - b.types == {"null"} and b.types < a.types:
            self.report(True, path, f"optional made required (no longer nullable: {change})")
        elif b.types - a.types == {"null"} and a.types < b.types:
            self.report(True, path, f"required made optional (now nullable: {change})")
        elif _within(b.types, a.types):
            self.report(True, path, f"type narrowed: {change}")
        elif _within(a.types, b.types):
            self.report(True, path, f"type widened: {change}")
        else:
            self.report(True, path, f"type changed: {change}")

    def values(self, a: _Node, b: _Node, path: str) -> None:
        if a.values == b.values:
            return
        if a.values is None:
            self.report(True, path, f"now restricted to {_list(b.values or set())}")
        elif b.values is None:
            self.report(True, path, f"no longer restricted to {_list(a.values)}")
        elif len(a.values) == len(b.values) == 1:
            self.report(True, path, f"value changed: {_list(a.values)} -> {_list(b.values)}")
        else:
            if a.values - b.values:
                self.report(True, path, f"enum value removed: {_list(a.values - b.values)}")
            if b.values - a.values:
                self.report(True, path, f"enum value added: {_list(b.values - a.values)}")

    def properties(self, a: _Node, b: _Node, path: str) -> None:
        removed = [n for n in a.properties if n not in b.properties]
        added = [n for n in b.properties if n not in a.properties]
        renamed = self._renames(a, b, removed, added)
        for name in removed:
            if name in renamed:
                what = f"renamed to {path}.{renamed[name]} (removed, and added with its schema)"
                self.report(True, f"{path}.{name}", what)
            else:
                self.report(True, f"{path}.{name}", "field removed")
        old_required, new_required = a.required or set(), b.required or set()
        for name in (n for n in a.properties if n in b.properties):
            where = f"{path}.{name}"
            old_schema, new_schema = _union(a.properties[name]), _union(b.properties[name])
            if (name in old_required) != (name in new_required):
                self.presence(old_schema, new_schema, name in new_required, where)
            self.schema(old_schema, new_schema, where)
        for name in added:
            if name in renamed.values():
                continue
            # A field with a default is not required: the messages already sent, which lack
            # it, stay valid. Any other new field makes them invalid, nullable or not.
            if name in new_required:
                self.report(True, f"{path}.{name}", _NEW_REQUIRED)
            else:
                self.report(False, f"{path}.{name}", "new optional field")

    def presence(self, old: Schema, new: Schema, required: bool, where: str) -> None:
        """A field kept, now required or no longer required."""
        was_null = "null" in _node(old, self.old_root).types
        if was_null != ("null" in _node(new, self.new_root).types):
            return  # types() reports it, as nullability: one line for one change
        if required:
            self.report(True, where, "optional made required")
        elif self.old_lists_written:
            return  # a lock of format 1 listed it as written; it still is
        elif "default" in new:
            # Staging writes defaults: a reader of the old contract gets it all the same.
            self.report(False, where, _NOW_DEFAULTED)
        else:
            self.report(True, where, "required made optional (no longer in every message)")

    def _renames(self, a: _Node, b: _Node, removed: list[str], added: list[str]) -> dict[str, str]:
        """Removed fields paired with added ones of the same schema, in order."""
        free = {n: _plain(_union(b.properties[n]), self.new_root) for n in added}
        renamed = {}
        for name in removed:
            shape = _plain(_union(a.properties[name]), self.old_root)
            match = next((n for n, s in free.items() if s == shape), None)
            if match is not None:
                renamed[name] = match
                del free[match]
        return renamed


def _node(schema: Schema, root: Schema) -> _Node:
    node = _Node()
    restricted = True
    required: set[str] | None = None
    for member in _members(schema, root):
        kind = member.get("type")
        types = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()
        listed = [member["const"]] if "const" in member else member.get("enum")
        if isinstance(listed, list):
            types = types or {_json_type(value) for value in listed}
            node.values = (node.values or set()) | {canonical(v) for v in listed}
        else:
            restricted = False
        if "properties" in member or "additionalProperties" in member:
            types = types or {"object"}
        node.types |= types or {"any"}
        node.bounds |= {
            f"{k}={json.dumps(v)}" for k, v in member.items() if k not in _COSMETIC | _STRUCTURE
        }
        for name, sub in member.get("properties", {}).items():
            node.properties.setdefault(name, []).append(sub)
        if "properties" in member:
            names = set(member.get("required", []))
            required = names if required is None else required & names
        if isinstance(member.get("items"), dict):
            node.items.append(member["items"])
        if isinstance(member.get("additionalProperties"), dict):
            node.extra.append(member["additionalProperties"])
    if not restricted:
        node.values = None
    node.required = required
    return node


def _members(schema: Schema, root: Schema) -> Iterator[Schema]:
    """The members of a union (anyOf, oneOf, allOf of one), each with its $ref followed."""
    schema = resolve(schema, root)
    union = schema.get("anyOf") or schema.get("oneOf")
    single = schema.get("allOf") if len(schema.get("allOf", [])) == 1 else None
    if isinstance(union, list) or isinstance(single, list):
        for member in union or single or []:
            yield from _members(member, root)
    else:
        yield schema


def _union(schemas: list[Schema]) -> Schema:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _plain(schema: Schema, root: Schema, depth: int = 0) -> str:
    """A schema with its references followed and its documentation left out, as text."""

    def strip(node: Any, level: int) -> Any:
        if isinstance(node, dict):
            if "$ref" in node and level < 8:
                node = resolve(node, root)
            return {k: strip(v, level + 1) for k, v in node.items() if k not in _COSMETIC}
        if isinstance(node, list):
            return [strip(item, level + 1) for item in node]
        return node

    return canonical(strip(schema, depth))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _within(inner: set[str], outer: set[str]) -> bool:
    """Every value of types ``inner`` is one of types ``outer`` (an integer is a number)."""
    return "any" in outer or all(
        t in outer or (t == "integer" and "number" in outer) for t in inner
    )


def _list(items: set[str]) -> str:
    return "|".join(sorted(items)) if items else "nothing"
