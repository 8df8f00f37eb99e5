"""``router preview``: the exact message each target would receive for one event.

The event goes through the real write path (``Stager.build_rows``: routes, destination, the
stored envelope, size limit) and the real delivery path (``Received``: the downcast to a
partner's pinned version, then ``BrokerSettings.render``; what the processor publishes), but
is neither written nor sent. Asked with ``skipped``, it is shown as the processor sends it
after a gap in its stream: those rows abandoned before it (docs/guarantees.md).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from enum import Enum
from typing import Any, TypeVar
from uuid import UUID

from pydantic import BaseModel, ValidationError

from brokers import BrokerSettings, NativeProperties
from envelopes import ConfigError, DowncastError, WireMessage
from router.config import RouterConfig
from router.write.catalog import EventCatalog
from router.write.events import Event, EventSpec
from router.write.pinning import Received
from router.write.staging import Row, Stager

M = TypeVar("M", bound=BaseModel)

__all__ = ["OnWire", "Preview", "example_of", "preview"]


@dataclass(frozen=True)
class OnWire:
    """One rendered message as the broker carries it: what ``router preview`` and the
    console's message view both show, computed here once."""

    destination: str
    binding: dict[str, Any]
    """Where it goes besides the destination: the exchange, the stream... (``location``)."""
    wire: WireMessage
    headers: dict[str, str]
    """Every header on the broker: the rendered ones and the adapter's own (``Nats-Msg-Id``,
    Kafka's ``correlation_id``...; ``BrokerSettings.native_headers``)."""
    properties: NativeProperties
    """The broker's own message properties (``BrokerSettings.native_properties``)."""

    @classmethod
    def of(cls, settings: BrokerSettings, destination: str, wire: WireMessage) -> OnWire:
        """``wire`` as the adapter of ``settings`` publishes it to ``destination``."""
        headers, properties = settings.native_headers(wire), settings.native_properties(wire)
        return cls(destination, settings.location(), wire, headers, properties)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the body parsed (as text when it is no JSON)."""
        return {
            "destination": self.destination,
            "binding": self.binding,
            "content_type": self.wire.content_type,
            "headers": self.headers,
            "properties": self.properties,
            "body": _document(self.wire.body),
        }


@dataclass(frozen=True)
class Preview:
    """What one target receives."""

    target: str
    kind: str
    profile: str
    sent: OnWire
    staged_version: int
    """The version of the event staged."""
    pinned_version: int | None = None
    """The version the target is pinned to for this event type (``versions:``), if any: the
    version it receives."""

    @property
    def destination(self) -> str:
        """The topic, subject, routing key... resolved at staging."""
        return self.sent.destination

    @property
    def wire(self) -> WireMessage:
        """The rendered message."""
        return self.sent.wire

    @property
    def headers(self) -> dict[str, str]:
        """Every header the message carries on the broker (``OnWire.headers``)."""
        return self.sent.headers

    @property
    def properties(self) -> NativeProperties:
        """The broker's own message properties."""
        return self.sent.properties

    def body_document(self) -> Any:
        """The body parsed as JSON (every profile's body is JSON)."""
        return json.loads(self.wire.body)

    def as_dict(self) -> dict[str, Any]:
        """For ``--json``."""
        return {
            "target": self.target,
            "kind": self.kind,
            "profile": self.profile,
            "staged_version": self.staged_version,
            "pinned_version": self.pinned_version,
            **self.sent.as_dict(),
        }


def _document(body: bytes) -> Any:
    """The body as JSON when it is JSON, else as text."""
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")


def preview(
    config: RouterConfig,
    catalog: EventCatalog,
    event_type: str,
    *,
    targets: Sequence[str] | None = None,
    database: str | None = None,
    version: int | None = None,
    payload: str | None = None,
    stream_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    extensions: Mapping[str, Any] | None = None,
    correlation_id: str | None = None,
    causation_id: str | None = None,
    tenant: str | None = None,
    priority: int | None = None,
    skipped: Sequence[str] = (),
) -> list[Preview]:
    """The messages ``targets`` (default: every target of the event) would receive.

    ``payload`` is the event as JSON; without it an example is made from the event class.
    ``version`` is the version staged: a target pinned to an older one gets it downcast, as
    it would from ``router serve``. ``skipped``: message ids of rows of its stream abandoned
    before it, which the message then names (a gap needs a ``stream_key``). The other keywords
    are ``stage()``'s. Raises ConfigError for an unknown type, target or database, an invalid
    payload, a gap without a stream key or a failing downcast, and StagingError for what
    ``stage()`` would refuse.
    """
    gap = _gap(skipped, stream_key)
    event_class = catalog.get(event_type, version)
    event = _event(event_class, payload)
    name = _database(config, database)
    rows = Stager(config).build_rows(
        name,
        [event],
        stream_key=stream_key,
        headers=headers,
        extensions=extensions,
        correlation_id=correlation_id,
        causation_id=causation_id,
        tenant=tenant,
        priority=priority,
    )
    by_target = {row.target: row for row in rows}
    wanted = list(targets) if targets else list(by_target)
    result = []
    for target in wanted:
        if target not in config.brokers:
            raise ConfigError(f"unknown target {target!r}; configured: {sorted(config.brokers)}")
        row = by_target.get(target)
        if row is None:
            raise ConfigError(_not_routed(config.brokers[target], target, event_class, name))
        result.append(_preview(config.brokers[target], target, event_class.__event__, row, gap))
    return result


def _gap(skipped: Sequence[str], stream_key: str | None) -> tuple[str, ...]:
    """``skipped`` as message ids; ConfigError for one that is none, or for a gap without a
    stream (only a keyed stream's rows are skipped and named)."""
    if not skipped:
        return ()
    if stream_key is None:
        raise ConfigError("a gap is in a stream: give --stream-key with --skipped")
    try:
        return tuple(str(UUID(text.strip())) for text in skipped)
    except ValueError:
        raise ConfigError(f"--skipped takes message ids; got {list(skipped)}") from None


def _preview(
    settings: BrokerSettings, target: str, spec: EventSpec, row: Row, skipped: tuple[str, ...]
) -> Preview:
    """What ``target`` receives of ``row``, as its processor would publish it (after the gap
    ``skipped`` in its stream)."""
    pinned = settings.versions.get(spec.type)
    try:
        wire = Received(settings)(row.envelope, sequence=1, skipped=skipped)
    except DowncastError as exc:
        raise ConfigError(
            f"target {target!r} is pinned to {spec.type!r} version {pinned}, and version "
            f"{spec.version} cannot be downcast to it: {exc}"
        ) from None
    sent = OnWire.of(settings, row.destination, wire)
    return Preview(target, settings.type, settings.profile, sent, spec.version, pinned)


def _event(event_class: type[Event], payload: str | None) -> Event:
    if payload is None:
        return example_of(event_class)
    try:
        return event_class.model_validate_json(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'payload'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ConfigError(
            f"--payload is not a valid {event_class.__event__.type}: {problems}"
        ) from None


def _database(config: RouterConfig, database: str | None) -> str:
    if database is None:
        if len(config.databases) == 1:
            return next(iter(config.databases))
        raise ConfigError(
            f"several databases are configured ({sorted(config.databases)}); pass --database"
        )
    if database not in config.databases:
        raise ConfigError(f"unknown database {database!r}; configured: {sorted(config.databases)}")
    return database


def _not_routed(settings: BrokerSettings, target: str, event_class: type[Event], db: str) -> str:
    spec = event_class.__event__
    if not settings.internal and not spec.published:
        why = "the event is not published (published=True), so only the internal broker gets it"
    elif not settings.wants(spec.type, published=spec.published):
        why = "the broker's events filter does not take it"
    else:
        why = f"database {db!r} does not publish to it"
    return f"target {target!r} does not receive {spec.type!r}: {why}"


# --- example payloads -------------------------------------------------------------------------


def example_of(model: type[M]) -> M:
    """An instance of ``model`` with a plausible value in every field: the field's first
    ``examples`` entry where it has one, else a value made from its type. Deterministic, so
    a preview can be compared from one run to the next."""
    values = {
        name: _example_field(name, info.annotation, info.examples)
        for name, info in model.model_fields.items()
    }
    return model.model_validate(values)


def _example_field(name: str, annotation: Any, examples: list[Any] | None) -> Any:
    if examples:
        return examples[0]
    return _example_value(name, annotation)


_SCALARS: dict[Any, Any] = {
    str: None,  # the field's name, see below
    int: 1,
    float: 1.5,
    bool: True,
    Decimal: Decimal("9.99"),
    datetime: datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
    date: date(2026, 1, 2),
    time: time(3, 4, 5),
    timedelta: timedelta(minutes=5),
    UUID: UUID("01890a5d-ac96-774b-bcce-b302099a8057"),
    bytes: b"bytes",
}


def _example_value(name: str, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is str:
        return f"{name}-1"
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return next(iter(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return example_of(annotation)
    if origin is typing.Literal:
        return args[0]
    if origin is typing.Annotated:
        return _example_value(name, args[0])
    if origin in (list, set, frozenset, tuple, Sequence) and args:
        return [_example_value(name, args[0])]
    if origin in (dict, Mapping) and len(args) == 2:
        return {_example_value("key", args[0]): _example_value(name, args[1])}
    if args:  # a union: its first member that is not None
        return _example_value(name, next(a for a in args if a is not type(None)))
    return None
