"""Per-partner version pinning: a partner pinned to an older version of an event type gets
the event downcast to it (``versions:`` in the broker's config, downcasters declared with
``Event.downcaster``; see ``router.write.events``).

Every target's row stores the event as staged; the downcast happens when the pinned
partner's row is published, so a downcaster that raises fails that row alone (it retries
with back-off, holding back only its own stream) and a fixed downcaster, once deployed,
delivers it. Stage time and start-up only check that a path of downcasters exists.

``Received`` is the one path from a stored envelope to what a target receives (downcast for
its pins, then rendered): the processor publishes what it makes, and ``router preview``, the
console's message view and ``router contract`` show it, so none of them can drift from what
is sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import orjson

from brokers import BrokerSettings
from envelopes import ConfigError, DowncastError, StagingError, WireMessage
from router.write.events import (
    EventSpec,
    downcast,
    downcast_path,
    event_class,
    event_versions,
)

__all__ = ["Pinning", "Received", "check_pin", "check_pins"]


class Pinning:
    """Rewrites stored envelopes of pinned event types for one partner (a processor calls
    it before rendering each row; rows of other types pass through unparsed but once)."""

    def __init__(self, pins: Mapping[str, int]) -> None:
        self.pins = dict(pins)

    def __call__(self, stored: str) -> str:
        """The envelope as the partner must receive it. Raises DowncastError, with the
        cause's message, when it cannot be made (whatever the user's downcaster raised)."""
        try:
            return self._downcast(stored)
        except Exception as exc:
            raise DowncastError(str(exc)) from exc

    def _downcast(self, stored: str) -> str:
        document = orjson.loads(stored)
        event_type, version = document.get("type"), document.get("version", 1)
        pinned = self.pins.get(event_type)
        if pinned is None or version <= pinned:
            return stored
        cls = event_class(event_type, version)
        if cls is None:
            raise LookupError(
                f"no class declares {event_type!r} version {version} in this process "
                "(list its module under events: in the config)"
            )
        older = downcast(cls.model_validate(document["payload"]), pinned)
        payload = older.model_dump_json().encode()
        document["version"] = pinned
        document["payload"] = orjson.Fragment(payload)
        document["checksum"] = "sha256:" + hashlib.sha256(payload).hexdigest()
        document["event_class"] = type(older).__event__.class_path
        return orjson.dumps(document).decode()


class Received:
    """What one target receives for a stored envelope: downcast to the target's pinned
    versions (``versions:``), then rendered for it (``BrokerSettings.render``). Made once per
    target; the processor's ``Delivery`` publishes what it returns."""

    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings
        self._pinning = Pinning(settings.versions) if settings.versions else None

    def __call__(
        self, stored: str, *, sequence: int | None, skipped: Sequence[str] = ()
    ) -> WireMessage:
        """The wire message (``skipped``: the gap before it in its stream, as message ids).
        Raises DowncastError when a pinned event cannot be downcast (the row retries),
        EnvelopeError when the envelope cannot be rendered."""
        if self._pinning is not None:
            stored = self._pinning(stored)
        return self.settings.render(stored, sequence=sequence, skipped=skipped)


def check_pin(spec: EventSpec, broker: str, pinned: int) -> None:
    """Raise StagingError unless an event of ``spec`` can reach a partner pinned to
    ``pinned``: it is that version, or downcasters lead from its version there."""
    if spec.version < pinned:
        raise StagingError(
            f"event {spec.type!r} is version {spec.version}, but broker {broker!r} is pinned "
            f"to version {pinned}: events are downcast to a pinned version, never upcast"
        )
    if downcast_path(spec.type, spec.version, pinned) is None:
        raise StagingError(
            f"event {spec.type!r} version {spec.version} cannot go to broker {broker!r}, "
            f"pinned to version {pinned}: declare a downcaster "
            f"(@{spec.class_path.rpartition('.')[2]}.downcaster(to={pinned}))"
        )


def check_pins(brokers: Mapping[str, Mapping[str, int]]) -> None:
    """At start-up, with the config's ``events:`` modules imported: every pin names a
    declared version, and every declared newer version downcasts to it. ConfigError names
    ``brokers.<name>.versions.<type>``."""
    for broker, pins in brokers.items():
        for event_type, pinned in pins.items():
            where = f"brokers.{broker}.versions.{event_type}"
            if event_class(event_type, pinned) is None:
                raise ConfigError(
                    f"{where}: no class declares {event_type!r} version {pinned} "
                    "(list its module under events:)"
                )
            for version in event_versions(event_type):
                cls = event_class(event_type, version)
                if cls is None or version <= pinned:
                    continue
                try:
                    check_pin(cls.__event__, broker, pinned)
                except StagingError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
