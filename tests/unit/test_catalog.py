"""The event catalog (config ``events:``) and the example payloads ``router preview`` makes."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from envelopes import ConfigError
from router import Event
from router.ops.preview import example_of
from router.write.catalog import load_catalog


def module(folder: Path, source: str) -> str:
    name = f"events_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(source)
    return name


V1_AND_V2 = """
from router import Event

class PlacedV1(Event, type="orders.placed", version=1, published=True):
    order_id: str

class PlacedV2(Event, type="orders.placed", version=2, published=True):
    order_id: str
    total: int
"""


def test_the_catalog_holds_every_event_of_the_modules_by_type_and_version(
    tmp_path: Path,
) -> None:
    name = module(tmp_path, V1_AND_V2)

    catalog = load_catalog([name], tmp_path)

    assert sorted(catalog.versions("orders.placed")) == [1, 2]
    assert catalog.get("orders.placed").__name__ == "PlacedV2"
    assert catalog.get("orders.placed", 1).__name__ == "PlacedV1"
    with pytest.raises(ConfigError, match=r"has no version 3; known versions: \[1, 2\]"):
        catalog.get("orders.placed", 3)
    with pytest.raises(ConfigError, match="unknown event type 'x'; known types: orders.placed"):
        catalog.get("x")


def test_a_module_that_fails_to_import_is_a_config_error_naming_its_place(
    tmp_path: Path,
) -> None:
    broken = module(tmp_path, "raise RuntimeError('no database here')\n")

    with pytest.raises(ConfigError) as error:
        load_catalog(["json", broken], tmp_path)

    assert str(error.value) == (
        f"events[1]: cannot import {broken!r}: RuntimeError: no database here"
    )


def test_two_classes_for_one_type_and_version_are_refused(tmp_path: Path) -> None:
    first = module(tmp_path, V1_AND_V2)
    second = module(tmp_path, V1_AND_V2)

    with pytest.raises(ConfigError, match=r"events\[1\]: .*PlacedV1 and .*PlacedV1 both declare"):
        load_catalog([first, second], tmp_path)


class Colour(Enum):
    RED = "red"


class Line(BaseModel):
    sku: str
    quantity: int


class Everything(Event, type="test.everything"):
    name: str
    count: int
    price: Decimal
    at: datetime
    colour: Colour
    kind: Literal["a", "b"]
    note: str | None
    lines: list[Line]
    tags: dict[str, int]


def test_an_example_has_a_valid_value_for_every_field() -> None:
    example = example_of(Everything)

    assert example.model_dump(mode="json") == {
        "name": "name-1",
        "count": 1,
        "price": "9.99",
        "at": "2026-01-02T03:04:05Z",
        "colour": "red",
        "kind": "a",
        "note": "note-1",
        "lines": [{"sku": "sku-1", "quantity": 1}],
        "tags": {"key-1": 1},
    }
