"""The committed references (docs/reference/) are what scripts/reference.py writes today, and
every config field has the description that reference shows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from brokers import AnyBrokerSettings
from router.config import RouterConfig
from scripts import reference


@pytest.mark.parametrize("relative", sorted(reference.OUTPUTS))
def test_committed_reference_is_current(relative: str) -> None:
    problem = reference.diff(relative, reference.OUTPUTS[relative]())
    if problem:
        pytest.fail(f"{relative} is stale: run `python scripts/reference.py`\n{problem}")


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    """Every model an annotation holds: itself, X | None, list[X], dict[str, X], unions."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for argument in get_args(annotation):
        yield from _models_in(argument)


def _config_models() -> list[type[BaseModel]]:
    """RouterConfig and every model under it, each broker kind included."""
    found: list[type[BaseModel]] = []
    pending: list[type[BaseModel]] = [RouterConfig]
    while pending:
        model = pending.pop()
        if model in found:
            continue
        found.append(model)
        for field in model.model_fields.values():
            pending += _models_in(field.annotation)
    return found


def test_the_walk_reaches_every_broker_kind() -> None:
    kinds = get_args(get_args(AnyBrokerSettings)[0])
    assert len(kinds) >= 6
    assert set(kinds) <= set(_config_models())


def test_every_config_field_has_a_description() -> None:
    missing = [
        f"{model.__module__}.{model.__name__}.{name}"
        for model in _config_models()
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert missing == [], "give these fields Field(description=...): they are in the reference"


def test_every_config_model_has_a_one_line_docstring() -> None:
    wrong = [
        f"{model.__module__}.{model.__name__}"
        for model in _config_models()
        if not model.__doc__ or len(model.__doc__.strip().splitlines()) != 1
    ]
    assert wrong == [], "the reference shows each model's docstring as its section's intro"
