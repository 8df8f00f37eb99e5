"""JSON Schema helpers of the contract: an event's payload as sent, projected, and moved into
an AsyncAPI document's ``components``."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import BaseModel

__all__ = [
    "Schema",
    "canonical",
    "glob_pattern",
    "hoist_definitions",
    "payload_schema",
    "project",
    "resolve",
    "without_null",
]

Schema = dict[str, Any]

_DEFS = "#/$defs/"


def payload_schema(model: type[BaseModel]) -> Schema:
    """The JSON schema of what ``model_dump_json()`` writes: serialisation mode (a Decimal is
    a string there), the names it writes (aliases only where the model serialises by alias).

    Staging writes every field, defaults included, yet only the fields without a default are
    ``required``: a message sent before a field with a default was added lacks it, and a
    partner validating with this schema must still accept that message."""
    by_alias = bool(model.model_config.get("serialize_by_alias", False))
    return model.model_json_schema(by_alias=by_alias, mode="serialization")


def project(schema: Schema, kept: Iterable[str] | None) -> Schema:
    """``schema`` with only the ``kept`` top-level properties (all when None), ``required``
    narrowed to them, and the ``$defs`` no kept property uses dropped."""
    if kept is None:
        return copy.deepcopy(schema)
    names = frozenset(kept)
    projected = {k: copy.deepcopy(v) for k, v in schema.items() if k != "$defs"}
    projected["properties"] = {
        name: value for name, value in projected.get("properties", {}).items() if name in names
    }
    if "required" in projected:
        projected["required"] = [name for name in projected["required"] if name in names]
    definitions = schema.get("$defs", {})
    used = _reachable(projected, definitions)
    if used:
        projected["$defs"] = {n: copy.deepcopy(d) for n, d in definitions.items() if n in used}
    return projected


def _reachable(schema: Schema, definitions: dict[str, Schema]) -> set[str]:
    seen: set[str] = set()
    pending = [schema]
    while pending:
        for ref in _refs(pending.pop()):
            name = ref.removeprefix(_DEFS)
            if ref.startswith(_DEFS) and name not in seen and name in definitions:
                seen.add(name)
                pending.append(definitions[name])
    return seen


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def resolve(schema: Schema, root: Schema) -> Schema:
    """Follow ``$ref`` into ``root``'s ``$defs`` until a schema without one (siblings of a
    ``$ref``, such as a description, are kept unless the target has its own)."""
    seen: set[str] = set()
    while isinstance(schema.get("$ref"), str) and schema["$ref"].startswith(_DEFS):
        name = schema["$ref"].removeprefix(_DEFS)
        if name in seen or name not in root.get("$defs", {}):
            break
        seen.add(name)
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**rest, **root["$defs"][name]}
    return schema


def without_null(schema: Schema) -> Schema:
    """``schema`` without its null branch: render leaves nulls out of an envelope, so a
    ``str | None`` envelope field is a string when it is there at all."""
    branches = schema.get("anyOf")
    if not isinstance(branches, list):
        return dict(schema)
    kept = [b for b in branches if b != {"type": "null"}]
    rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    if len(kept) == 1:
        return {**rest, **kept[0]}
    return {**rest, "anyOf": kept}


def hoist_definitions(schema: Schema, components: dict[str, Schema], owner: str) -> Schema:
    """``schema`` with its ``$defs`` moved into ``components`` (an AsyncAPI document's
    ``components.schemas``) and its references rewritten to point there. A name already
    taken by a different schema gets ``owner`` in front of it."""
    definitions: dict[str, Schema] = schema.get("$defs", {})
    renamed = {name: name for name in definitions}
    clash = True
    while clash:  # renaming one may make another that points to it differ: until none does
        clash = False
        for name, definition in definitions.items():
            taken = components.get(renamed[name])
            if taken is not None and taken != _rewrite(definition, renamed):
                if renamed[name] != name:
                    raise ValueError(f"two schemas named {renamed[name]!r}")
                renamed[name], clash = f"{owner}.{name}", True
    for name, definition in definitions.items():
        components[renamed[name]] = _rewrite(definition, renamed)
    body: Schema = _rewrite({k: v for k, v in schema.items() if k != "$defs"}, renamed)
    return body


def _rewrite(node: Any, renamed: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {
            key: (
                "#/components/schemas/" + renamed.get(value.removeprefix(_DEFS), value)
                if key == "$ref" and isinstance(value, str) and value.startswith(_DEFS)
                else _rewrite(value, renamed)
            )
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_rewrite(item, renamed) for item in node]
    return node


# Characters with a meaning in a regular expression, escaped the same way in Python's and
# ECMA 262's syntax (a JSON Schema pattern is ECMA 262).
_SPECIAL = frozenset("\\^$.|?*+()[]{}/")


def glob_pattern(glob: str) -> str:
    """A case-insensitive glob (``fnmatch``: ``*``, ``?``, ``[...]``) as an anchored ECMA 262
    regular expression, for ``patternProperties`` (which has no flags)."""
    out = ["^"]
    i = 0
    while i < len(glob):
        char = glob[i]
        if char == "*":
            out.append(".*")
        elif char == "?":
            out.append(".")
        elif char == "[" and "]" in glob[i + 2 :]:
            end = glob.index("]", i + 2)
            inner = glob[i + 1 : end]
            body = inner.removeprefix("!").replace("\\", "\\\\")
            cases = body if body.swapcase() == body else body + body.swapcase()
            out.append(("[^" if inner.startswith("!") else "[") + cases + "]")
            i = end
        elif char.lower() != char.upper():
            out.append(f"[{_both_cases(char)}]")
        else:
            out.append("\\" + char if char in _SPECIAL else char)
        i += 1
    out.append("$")
    return "".join(out)


def _both_cases(char: str) -> str:
    return char if char.lower() == char.upper() else char.lower() + char.upper()


def canonical(schema: Any) -> str:
    """A schema as sorted JSON, for comparing two schemas."""
    return json.dumps(schema, sort_keys=True, ensure_ascii=False)
