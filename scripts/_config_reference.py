"""The configuration reference (docs/reference/configuration.md), from the config models.

One section per model, depth first from ``RouterConfig``; a map of a union of models (the
brokers) gets a section per kind with that kind's own keys, then one with the keys they share.
"""

from __future__ import annotations

import inspect
import re
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from router.config import RouterConfig
from scripts._markdown import HEADER, cell, one_of, text

__all__ = ["configuration_markdown"]

_INTRO = """\
Keys are YAML paths; `<name>` stands for a name you choose. Unknown keys are errors.
Any value may be written `${VAR}` or `${VAR:-default}` to take it from the environment:
write secrets that way, never in the file. A duration is `45s`, `30m`, `12h`, `7d`, `1w`,
a number of seconds, or ISO 8601."""


@dataclass(frozen=True)
class _Section:
    path: str
    title: str
    intro: str
    rows: tuple[tuple[str, str, str, str], ...]  # key, type, default, description


def configuration_markdown() -> str:
    """The configuration reference, from ``RouterConfig`` and every model under it."""
    lines = ["# Configuration reference", "", HEADER.format(source="config models"), ""]
    lines += [_INTRO, ""]
    for section in _sections(RouterConfig, "", "Top level"):
        lines += [f"## {section.title}", "", text(section.intro), ""]
        if section.rows:
            lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
            lines += ["| " + " | ".join(row) + " |" for row in section.rows]
        else:
            lines.append("No keys besides the shared ones.")
        lines.append("")
    return "\n".join(lines)


def _sections(
    model: type[BaseModel],
    path: str,
    title: str,
    *,
    skip: frozenset[str] = frozenset(),
    types_of: dict[str, str] | None = None,
    note: str = "",
) -> list[_Section]:
    """A model's own table, then the sections of the models under it, depth first."""
    rows: list[tuple[str, str, str, str]] = []
    below: list[_Section] = []
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        key = f"{path}.{name}" if path else name
        nested = _nested(key, field.annotation, note)
        kind = (types_of or {}).get(name) or _type(field.annotation, field.metadata, field)
        if nested:
            kind += f" (see `{nested[0].path}`)"
        rows.append((f"`{key}`", cell(kind), _default(field), cell(text(field.description))))
        below += nested
    return [_Section(path, title, _docstring(model), tuple(rows)), *below]


def _nested(key: str, annotation: Any, note: str) -> list[_Section]:
    """The sections of a field holding a model, a map of models or a map of a union of them."""
    inner = _unwrap(annotation)
    if get_origin(inner) is dict:
        value = get_args(inner)[1]
        key, inner = f"{key}.<name>", _unwrap(value)
        if _is_union(inner):
            return _union_sections(key, list(get_args(inner)), _discriminator(value))
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return _sections(inner, key, f"`{key}`{note}", note=note)
    return []


def _union_sections(path: str, members: list[type[BaseModel]], tag: str) -> list[_Section]:
    """One section per kind (its own keys), then the keys every kind shares, once."""
    base = next(c for c in members[0].__mro__ if all(issubclass(m, c) for m in members))
    if not issubclass(base, BaseModel) or base is BaseModel:
        raise TypeError(f"{path}: the kinds of a union share no settings model")
    shared = frozenset(base.model_fields)
    kinds = [get_args(m.model_fields[tag].annotation)[0] for m in members]
    sections = []
    for member, kind in zip(members, kinds, strict=True):
        title, note = f"`{path}` with `{tag}: {kind}`", f" (`{tag}: {kind}`)"
        sections += _sections(member, path, title, skip=shared, note=note)
    sections += _sections(base, path, f"`{path}`: every {tag}", types_of={tag: one_of(kinds)})
    return sections


def _discriminator(annotation: Any) -> str:
    """The tag field of a union of models: ``Annotated[A | B, Field(discriminator=...)]``."""
    for item in get_args(annotation)[1:]:
        if isinstance(item, FieldInfo) and isinstance(item.discriminator, str):
            return item.discriminator
    raise TypeError(f"{annotation!r}: a union of models needs a discriminator")


def _type(annotation: Any, metadata: Sequence[Any], field: FieldInfo) -> str:
    """A type as a reader would say it: ``int ≥ 1``, ``seconds > 0``, ``one of: a, b``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type(args[0], [*metadata, *args[1:]], field)
    if _is_union(annotation):
        kept = [a for a in args if a is not type(None)]
        if len(kept) == 1:
            return _type(kept[0], metadata, field)
        if all(isinstance(a, type) and issubclass(a, BaseModel) for a in kept):
            return "mapping by type"
        return " or ".join(_type(a, metadata, field) for a in kept)
    if origin is Literal:
        return one_of(list(args))
    if origin is list:
        return _sized(f"list of {_type(args[0], (), field)}", metadata)
    if origin is dict:
        return f"map of {_type(args[0], (), field)} to {_type(args[1], (), field)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return _scalar(annotation, metadata, field)


def _scalar(annotation: Any, metadata: Sequence[Any], field: FieldInfo) -> str:
    if annotation is bool:
        return "bool"
    if annotation is timedelta:
        return "duration like 7d"
    if annotation is SecretStr:
        return "string, secret: use `${VAR}`"
    if annotation is str:
        pattern = _constraints(metadata).get("pattern")
        return _sized("string", metadata) + (f" matching `{pattern}`" if pattern else "")
    if annotation in (int, float):
        # The unit is the one the description names: "Seconds before...", "..., in bytes".
        unit = re.search(r"\b(seconds|bytes)\b", field.description or "", re.IGNORECASE)
        name = unit.group(1).lower() if unit else {int: "int", float: "number"}[annotation]
        return _bounded(name, metadata)
    raise TypeError(f"scripts/reference.py cannot describe the type {annotation!r}")


def _constraints(metadata: Sequence[Any]) -> dict[str, Any]:
    found = {}
    for item in metadata:
        for name in ("gt", "ge", "lt", "le", "min_length", "max_length", "pattern"):
            value = None if isinstance(item, FieldInfo) else getattr(item, name, None)
            if value is not None:
                found[name] = value
    return found


def _bounded(name: str, metadata: Sequence[Any]) -> str:
    """``int ≥ 1``, ``number > 0``, ``1 ≤ int ≤ 100``."""
    bounds = _constraints(metadata)
    low = next(((s, bounds[k]) for k, s in (("ge", "≥"), ("gt", ">")) if k in bounds), None)
    high = next(((s, bounds[k]) for k, s in (("le", "≤"), ("lt", "<")) if k in bounds), None)
    if low and high:
        flipped = {"≥": "≤", ">": "<"}[low[0]]
        return f"{_number(low[1])} {flipped} {name} {high[0]} {_number(high[1])}"
    bound = low or high
    return f"{name} {bound[0]} {_number(bound[1])}" if bound else name


def _sized(kind: str, metadata: Sequence[Any]) -> str:
    """``string, 1 to 255 long``, ``list of string, at least 1``."""
    bounds = _constraints(metadata)
    low, high = bounds.get("min_length"), bounds.get("max_length")
    if low is not None and high is not None:
        return f"{kind}, {low} to {high} long"
    if low is not None:
        return f"{kind}, at least {low} long" if kind == "string" else f"{kind}, at least {low}"
    return f"{kind}, at most {high} long" if high is not None else kind


def _default(field: FieldInfo) -> str:
    """The default as YAML would show it; ``required`` when there is none."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "each key's default"
    return f"`{cell(_yaml(value))}`"


def _yaml(value: Any) -> str:
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, timedelta):
        seconds = int(value.total_seconds())
        unit, size = next(
            (u, s) for u, s in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)) if seconds % s == 0
        )
        return f"{seconds // size}{unit}"
    dumped = yaml.safe_dump(value, default_flow_style=True, width=sys.maxsize, allow_unicode=True)
    return dumped.removesuffix("...\n").strip()


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _unwrap(annotation: Any) -> Any:
    """``X`` of ``X | None`` and of ``Annotated[X, ...]``."""
    if get_origin(annotation) is Annotated:
        return _unwrap(get_args(annotation)[0])
    if _is_union(annotation):
        kept = [a for a in get_args(annotation) if a is not type(None)]
        if len(kept) == 1:
            return _unwrap(kept[0])
    return annotation


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _docstring(model: type[BaseModel]) -> str:
    return " ".join(inspect.cleandoc(model.__doc__ or "").split())
