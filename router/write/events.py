"""Events: pydantic models that say what they are called, their version, and who may see them.

    class OrderPlaced(Event, type="orders.order_placed", version=2, published=True):
        order_id: str
        total: Decimal

``published=True`` sends the event to external brokers too (each narrowed by its own
``events`` filter); otherwise only the internal broker gets it. ``destination`` is the value of
``{destination}`` in a broker's destination template (default: the type name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

__all__ = ["Event", "EventSpec", "correlation", "current_correlation_id"]

_correlation_id: ContextVar[str | None] = ContextVar("router_correlation_id", default=None)


@dataclass(frozen=True, slots=True)
class EventSpec:
    """What the router knows about an event class."""

    type: str
    version: int
    published: bool
    destination: str | None
    class_path: str


class Event(BaseModel):
    """Base class of every event; subclass it with class keywords (see the module docstring)."""

    model_config = ConfigDict(frozen=True)

    __event__: ClassVar[EventSpec] = EventSpec("Event", 1, False, None, "router.write.events.Event")

    def __init_subclass__(
        cls,
        *,
        type: str | None = None,
        version: int | None = None,
        published: bool | None = None,
        destination: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        parent = cls.__event__
        if version is not None and (not isinstance(version, int) or version < 1):
            raise TypeError(f"{cls.__name__}: version must be a positive integer")
        if type is not None and not type.strip():
            raise TypeError(f"{cls.__name__}: type must not be empty")
        cls.__event__ = EventSpec(
            type=type or cls.__name__,
            version=parent.version if version is None else version,
            published=parent.published if published is None else published,
            destination=parent.destination if destination is None else destination,
            class_path=f"{cls.__module__}.{cls.__qualname__}",
        )


def current_correlation_id() -> str | None:
    """The correlation id set by ``correlation()`` in this context, if any."""
    return _correlation_id.get()


@contextlib.contextmanager
def correlation(correlation_id: str) -> Iterator[str]:
    """Stage every event inside this block with ``correlation_id`` (unless one is passed)."""
    token = _correlation_id.set(correlation_id)
    try:
        yield correlation_id
    finally:
        _correlation_id.reset(token)
