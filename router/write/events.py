"""Events: pydantic models that say what they are called, their version, and who may see them.

    class OrderPlaced(Event, type="orders.order_placed", version=2, published=True):
        order_id: str
        total: Decimal

``published=True`` sends the event to external brokers too (each narrowed by its own
``events`` filter); otherwise only the internal broker gets it. ``destination`` is the value of
``{destination}`` in a broker's destination template (default: the type name).

A partner may pin an event type to an older version (``versions:`` in its broker config).
The newer class then says how to make the older one::

    @OrderPlaced.downcaster(to=1)
    def _(event: OrderPlaced) -> OrderPlacedV1:
        return OrderPlacedV1(order_id=event.order_id, total=event.total)

Downcasters chain (v3 -> v2 -> v1); the pinned partner gets the result, every other target
the event as staged.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

__all__ = [
    "Downcaster",
    "Event",
    "EventSpec",
    "correlation",
    "current_correlation_id",
    "downcast",
    "downcast_path",
    "event_class",
    "event_versions",
]

_correlation_id: ContextVar[str | None] = ContextVar("router_correlation_id", default=None)


Downcaster = Callable[[Any], "Event"]

# Every event class by (type, version), the latest definition winning; and the downcasters
# declared on them, by (type, from version) then target version. Filled as classes are
# defined: the router process defines them by importing the config's ``events:`` modules.
_CLASSES: dict[tuple[str, int], type[Event]] = {}
_DOWNCASTERS: dict[tuple[str, int], dict[int, Downcaster]] = {}


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
        _CLASSES[(cls.__event__.type, cls.__event__.version)] = cls

    @classmethod
    def downcaster(cls, *, to: int) -> Callable[[Downcaster], Downcaster]:
        """Declare a function that turns an event of this class into the same type at
        version ``to`` (lower than this class's version); see the module docstring."""
        spec = cls.__event__
        if not isinstance(to, int) or not 1 <= to < spec.version:
            raise TypeError(
                f"{cls.__name__}.downcaster(to={to!r}): 'to' must be a version below {spec.version}"
            )

        def register(function: Downcaster) -> Downcaster:
            _DOWNCASTERS.setdefault((spec.type, spec.version), {})[to] = function
            return function

        return register


def event_class(event_type: str, version: int) -> type[Event] | None:
    """The class defined last for this type and version in this process, if any."""
    return _CLASSES.get((event_type, version))


def event_versions(event_type: str) -> list[int]:
    """The versions of a type that classes in this process declare, ascending."""
    return sorted(version for (name, version) in _CLASSES if name == event_type)


def downcast_path(event_type: str, version: int, pinned: int) -> list[int] | None:
    """The versions a downcast from ``version`` to ``pinned`` goes through, ``pinned`` last
    (empty when they are equal), or None when the declared downcasters lead no way there.
    The shortest path, so a direct downcaster is preferred to a chain."""
    previous: dict[int, int] = {version: version}
    queue = deque([version])
    while queue:
        current = queue.popleft()
        if current == pinned:
            path = []
            while current != version:
                path.append(current)
                current = previous[current]
            return path[::-1]
        for target in sorted(_DOWNCASTERS.get((event_type, current), {})):
            if target not in previous:
                previous[target] = current
                queue.append(target)
    return None


def downcast(event: Event, pinned: int) -> Event:
    """``event`` as version ``pinned`` of its type, through the declared downcasters.

    Raises LookupError when no path leads there, and TypeError when a downcaster returns
    anything but an event of the same type at the version it was declared for.
    """
    spec = type(event).__event__
    path = downcast_path(spec.type, spec.version, pinned)
    if path is None:
        raise LookupError(
            f"event {spec.type!r} has no downcasters from version {spec.version} to {pinned}"
        )
    for target in path:
        current = type(event).__event__
        function = _DOWNCASTERS[(current.type, current.version)][target]
        event = function(event)
        made = getattr(type(event), "__event__", None)
        if (
            not isinstance(event, Event)
            or made is None
            or (made.type, made.version)
            != (
                current.type,
                target,
            )
        ):
            raise TypeError(
                f"the downcaster of {current.type!r} from version {current.version} to "
                f"{target} returned {type(event).__name__}, not an event of version {target}"
            )
    return event


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
