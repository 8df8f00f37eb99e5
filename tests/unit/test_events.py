"""Event classes (what they are called, their version, who may see them) and the correlation
context that stamps every event staged inside it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router import Event, EventSpec, correlation, current_correlation_id


class Placed(Event, type="orders.placed", version=2, published=True, destination="orders"):
    order_id: str


class Reserved(Event):
    sku: str


class Amended(Placed):
    reason: str


class Corrected(Amended, type="orders.corrected", version=3, published=False):
    pass


def spec_of(event_class: type[Event]) -> tuple[str, int, bool, str | None]:
    spec: EventSpec = event_class.__event__
    return (spec.type, spec.version, spec.published, spec.destination)


def test_class_keywords_become_the_event_spec() -> None:
    assert spec_of(Placed) == ("orders.placed", 2, True, "orders")
    assert Placed.__event__.class_path == f"{__name__}.Placed"


def test_without_keywords_the_type_is_the_class_name_version_1_and_internal_only() -> None:
    assert spec_of(Reserved) == ("Reserved", 1, False, None)


def test_subclasses_inherit_version_published_and_destination_but_not_the_type() -> None:
    assert spec_of(Amended) == ("Amended", 2, True, "orders")
    assert Amended.__event__.class_path == f"{__name__}.Amended"


def test_a_subclass_can_override_what_it_inherits() -> None:
    assert spec_of(Corrected) == ("orders.corrected", 3, False, "orders")
    assert spec_of(Placed) == ("orders.placed", 2, True, "orders")  # the parent is unchanged


def define(**keywords: Any) -> type[Event]:
    """Define an event class with these class keywords, as a ``class`` statement would."""
    return type("Bad", (Event,), {"__module__": __name__}, **keywords)


@pytest.mark.parametrize("version", [0, -1, 1.5, "2"])
def test_an_invalid_version_is_refused(version: object) -> None:
    with pytest.raises(TypeError, match="Bad: version must be a positive integer"):
        define(version=version)


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_type_is_refused(name: str) -> None:
    with pytest.raises(TypeError, match="Bad: type must not be empty"):
        define(type=name)


def test_events_are_immutable_facts() -> None:
    event = Placed(order_id="o-1")
    with pytest.raises(ValueError, match="frozen"):
        event.order_id = "o-2"  # type: ignore[misc]


def test_correlation_sets_the_id_for_its_block_and_restores_it_even_when_nested() -> None:
    assert current_correlation_id() is None
    with correlation("outer") as outer:
        assert outer == "outer"
        assert current_correlation_id() == "outer"
        with correlation("inner"):
            assert current_correlation_id() == "inner"
        assert current_correlation_id() == "outer"
    assert current_correlation_id() is None


def test_correlation_is_restored_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), correlation("doomed"):
        raise RuntimeError("handler failed")
    assert current_correlation_id() is None


async def test_concurrent_tasks_each_keep_their_own_correlation_id() -> None:
    seen: dict[str, str | None] = {}
    both_inside = asyncio.Barrier(2)

    async def handle(name: str) -> None:
        with correlation(name):
            await both_inside.wait()  # both blocks are open at the same time here
            seen[name] = current_correlation_id()

    await asyncio.gather(handle("a"), handle("b"))
    assert seen == {"a": "a", "b": "b"}
    assert current_correlation_id() is None


async def test_a_task_started_inside_a_block_inherits_its_id_but_cannot_change_the_parents() -> (
    None
):
    async def child() -> str | None:
        inherited = current_correlation_id()
        with correlation("child"):
            await asyncio.sleep(0)
        return inherited

    with correlation("parent"):
        assert await asyncio.create_task(child()) == "parent"
        assert current_correlation_id() == "parent"
