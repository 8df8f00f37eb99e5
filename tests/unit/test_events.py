"""Event classes and the correlation context."""

from __future__ import annotations

import asyncio

import pytest

from router import Event, correlation, current_correlation_id


class Placed(Event, type="orders.placed", version=2, published=True, destination="orders"):
    order_id: str


class Reserved(Event):
    sku: str


class Amended(Placed):
    reason: str


def test_class_keywords_become_the_event_spec() -> None:
    spec = Placed.__event__
    assert (spec.type, spec.version, spec.published, spec.destination) == (
        "orders.placed",
        2,
        True,
        "orders",
    )
    assert spec.class_path.endswith("test_events.Placed")


def test_defaults_are_the_class_name_version_1_and_internal_only() -> None:
    spec = Reserved.__event__
    assert (spec.type, spec.version, spec.published, spec.destination) == (
        "Reserved",
        1,
        False,
        None,
    )


def test_subclasses_inherit_version_published_and_destination_but_not_the_type() -> None:
    spec = Amended.__event__
    assert spec.type == "Amended"
    assert (spec.version, spec.published, spec.destination) == (2, True, "orders")


@pytest.mark.parametrize("version", [0, -1])
def test_a_version_below_one_is_refused(version: int) -> None:
    with pytest.raises(TypeError, match="version must be a positive integer"):
        type("Bad", (Event,), {"__annotations__": {}}, version=version)


def test_events_are_immutable_facts() -> None:
    event = Placed(order_id="o-1")
    with pytest.raises(ValueError, match="frozen"):
        event.order_id = "o-2"  # type: ignore[misc]


def test_correlation_sets_and_restores_the_id_even_when_nested() -> None:
    assert current_correlation_id() is None
    with correlation("outer"):
        assert current_correlation_id() == "outer"
        with correlation("inner"):
            assert current_correlation_id() == "inner"
        assert current_correlation_id() == "outer"
    assert current_correlation_id() is None


async def test_correlation_ids_do_not_leak_between_tasks() -> None:
    seen: dict[str, str | None] = {}

    async def handle(name: str) -> None:
        with correlation(name):
            await asyncio.sleep(0.01)
            seen[name] = current_correlation_id()

    await asyncio.gather(handle("a"), handle("b"))
    assert seen == {"a": "a", "b": "b"}
