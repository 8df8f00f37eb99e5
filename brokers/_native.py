"""What the adapters derive from a rendered message for a broker's own message fields.

Every value a broker carries besides the body and the rendered headers comes from the stored
event alone (its id, type, time, correlation id, staged priority) and the broker's settings,
never from the moment or the library that publishes it: the same row published again gives
the same message, property for property.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from envelopes import WireMessage

__all__ = ["NativeProperties", "event_millis", "event_seconds"]

NativeProperties = dict[str, str | int]
"""A broker's own message properties by the name its ordinary client gives them."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _event_time(wire: WireMessage) -> datetime | None:
    if not wire.time:
        return None
    moment = datetime.fromisoformat(wire.time)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def event_seconds(wire: WireMessage) -> int | None:
    """The event's time in whole seconds since the epoch (an AMQP 0-9-1 timestamp)."""
    moment = _event_time(wire)
    return None if moment is None else (moment - _EPOCH) // timedelta(seconds=1)


def event_millis(wire: WireMessage) -> int | None:
    """The event's time in milliseconds since the epoch (a Kafka record timestamp)."""
    moment = _event_time(wire)
    return None if moment is None else (moment - _EPOCH) // timedelta(milliseconds=1)
