"""The write path: turn events into outbox rows inside the caller's transaction.

One event becomes one row per target: the internal broker always, and every external broker
whose filter takes it when the event is ``published``. All rows of one ``stage()`` call go in
with one INSERT, made by the database's module (``router.write.postgres``, ``mysql``,
``sqlite``) and run by a driver (``router.write.drivers``, ``async_drivers``): ``Stager`` does
no I/O. Anything that would make a row undeliverable (a
payload that does not serialise, an envelope over the size limit, an event no broker takes, a
destination a broker cannot accept) raises ``StagingError`` before anything is written.

Each event has one stream key: ``stream_key`` gives every event of the call the same one,
``stream_keys`` one per event, so a batch over many streams is still one INSERT; rows go in
the order of the events, so per stream key, seq follows the order given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Unpack

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from brokers import EventRoute
from envelopes import (
    EnvelopeError,
    EnvelopeTemplate,
    StageOptions,
    StagingError,
    check_cloudevents_extensions,
    make_internal_envelope,
    uuid7_text,
)
from router.config import RouterConfig
from router.write.checks import check_no_nul, json_problem
from router.write.events import Event, EventSpec
from router.write.mysql import mysql_statements
from router.write.pinning import check_pin
from router.write.postgres import PostgresStatements
from router.write.sqlite import SqliteStatements
from router.write.statements import Copy, Row, Statement, clause

__all__ = ["Copy", "Route", "Row", "Stager", "Statement", "clause"]

_COLUMNS = "message_id, target, destination, event_type, stream_key, envelope"


@dataclass(frozen=True, slots=True)
class Route:
    """One target of an event class, with the destination resolved for it."""

    target: str
    destination: str


class Stager:
    """Builds rows for events (with routes cached per event class) and inserts them."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._routes: dict[tuple[str, type[Event]], list[Route]] = {}
        self._event_classes: set[type[Event]] = set()
        self._postgres = PostgresStatements()
        self._sqlite = SqliteStatements()
        self._headers_carried: set[tuple[str, tuple[str, ...]]] = set()
        self._cloudevents: dict[str, frozenset[str]] = {}
        self._atomic: dict[str, dict[str, int]] = {}
        self._plans: dict[tuple[str, type[Event]], _Plan] = {}

    def atomic_limits(self, database: str) -> dict[str, int]:
        """The targets of ``database`` with ``atomic: true``, each with the most rows one
        transaction may stage for it (its broker's atomic write, ``max_unit``)."""
        found = self._atomic.get(database)
        if found is None:
            found = self._atomic[database] = {
                name: broker.max_unit
                for name, broker in self.config.brokers_of(database).items()
                if broker.atomic and broker.max_unit is not None
            }
        return found

    def _cloudevents_targets(self, database: str) -> frozenset[str]:
        """Brokers that carry extensions as CloudEvents attributes (known once per database)."""
        found = self._cloudevents.get(database)
        if found is None:
            found = self._cloudevents[database] = frozenset(
                name
                for name, broker in self.config.brokers_of(database).items()
                if broker.profile == "cloudevents" and "extensions" not in broker.omit
            )
        return found

    def routes(self, database: str, event_class: type[Event]) -> list[Route]:
        """The targets and destinations of an event class in one database."""
        key = (database, event_class)
        cached = self._routes.get(key)
        if cached is None:
            cached = self._routes[key] = self._resolve(database, event_class.__event__)
        return cached

    def build_rows(
        self,
        database: str,
        events: Sequence[Event],
        *,
        stream_key: str | None = None,
        stream_keys: Sequence[str | None] | None = None,
        **options: Unpack[StageOptions],
    ) -> list[Row]:
        """Validate events and turn each into one row per target (raises StagingError).

        The keywords are ``Outbox.stage()``'s: one stream key for all events or one per event,
        and the metadata every envelope of the call carries.
        """
        if (
            not options
            and stream_keys is None
            and len(events) == 1
            and (stream_key is None or type(stream_key) is str)
        ):
            planned = self._one(database, events[0], stream_key)
            if planned is not None:
                return planned
        keys: Sequence[str | None]
        if stream_keys is None and _only_text_ids(stream_key, options):
            # The common call: one stream key or none, and no metadata but the ids a context
            # sets (correlation, traceparent), each a str. The type checks (a strict
            # validation) and the checks of headers and extensions can find nothing in it;
            # what the others could, a NUL in the key or an id, is looked for in their order.
            check_no_nul(stream_key, "stream_key")
            for name in _TEXT_IDS:
                check_no_nul(options.get(name), name)
            keys = [stream_key] * len(events)
            extensions = headers = None
        else:
            _check_options(stream_key, options)
            keys = _keys_per_event(stream_key, stream_keys, len(events))
            _check_texts(stream_key, stream_keys, options)
            extensions = options.get("extensions")
            problem = json_problem(extensions, "extensions") if extensions else None
            if problem is not None:
                raise StagingError(problem)
            headers = options.get("headers")
        headers_checked: set[str] = set()
        limit = self.config.outbox.max_payload_bytes
        cloudevents = self._cloudevents_targets(database) if extensions else frozenset()
        now = datetime.now(UTC)
        rows: list[Row] = []
        for event, key in zip(events, keys, strict=True):
            # isinstance() on a pydantic model class goes through ABCMeta's check; the classes
            # seen already are a set lookup.
            if type(event) not in self._event_classes:
                if not isinstance(event, Event):
                    raise StagingError(f"stage() takes router.Event instances, got {type(event)!r}")
                self._event_classes.add(type(event))
            spec = type(event).__event__
            routes = self.routes(database, type(event))
            if extensions and any(r.target in cloudevents for r in routes):
                try:
                    check_cloudevents_extensions(extensions)
                except EnvelopeError as exc:
                    raise StagingError(f"event {spec.type!r}: {exc}") from None
            if headers:
                self._check_headers(headers, routes, headers_checked)
            message_id = uuid7_text()
            envelope = self._envelope(event, spec, message_id, key, now, options)
            if len(envelope) > limit:
                raise StagingError(_too_large(spec, envelope, limit))
            stored = envelope.decode()
            for r in routes:
                rows.append(Row(message_id, r.target, r.destination, spec.type, key, stored))
        return rows

    def _one(self, database: str, event: Event, stream_key: str | None) -> list[Row] | None:
        """``build_rows`` for its most common call: one event, a stream key or none, and no
        metadata. The same rows, from what was worked out for the event's class once (its
        routes, its envelope's template): a fifth of the call's own work (#39). None for a
        class without a template (``build_rows`` then goes the general way)."""
        plan = self._plans.get((database, type(event)))
        if plan is None:
            plan = self._plan(database, event)
        spec, routes, template = plan
        if template is None:
            return None
        check_no_nul(stream_key, "stream_key")
        message_id = uuid7_text()
        envelope = template.make(message_id, datetime.now(UTC), stream_key, _payload(event, spec))
        if len(envelope) > self.config.outbox.max_payload_bytes:
            raise StagingError(_too_large(spec, envelope, self.config.outbox.max_payload_bytes))
        stored = envelope.decode()
        return [Row(message_id, t, d, spec.type, stream_key, stored) for t, d in routes]

    def _plan(self, database: str, event: Event) -> _Plan:
        """What ``_one`` keeps of an event class in a database (StagingError as build_rows
        raises it for an event that cannot go)."""
        if not isinstance(event, Event):
            raise StagingError(f"stage() takes router.Event instances, got {type(event)!r}")
        spec = type(event).__event__
        routes = tuple((r.target, r.destination) for r in self.routes(database, type(event)))
        template: EnvelopeTemplate | None
        try:
            template = EnvelopeTemplate(
                event_type=spec.type,
                version=spec.version,
                source=self.config.service,
                event_class=spec.class_path,
            )
        except EnvelopeError:
            template = None
        plan = (spec, routes, template)
        if len(self._plans) < 1024:  # an application's event classes are few
            self._plans[(database, type(event))] = plan
        return plan

    def _check_headers(
        self, headers: Mapping[str, str], routes: list[Route], done: set[str]
    ) -> None:
        """Refuse a staged header a target broker would receive but cannot carry; ``done``
        holds the targets checked already in this call."""
        for route in routes:
            if route.target in done:
                continue
            done.add(route.target)
            key = (route.target, tuple(headers))
            if key in self._headers_carried:
                continue
            broker = self.config.brokers[route.target]
            refused = broker.refused_header(headers)
            if refused is not None:
                name, reason = refused
                raise StagingError(
                    f"header {name!r} cannot go to broker {route.target!r} ({broker.type}): "
                    f"{reason}"
                )
            # The header names an application stages are few: remember those that pass.
            if len(self._headers_carried) >= 1024:
                self._headers_carried.clear()
            self._headers_carried.add(key)

    def statements(
        self,
        dialect: str,
        rows: Sequence[Row],
        *,
        copy: bool = False,
        simple: bool = False,
        notify: bool = True,
    ) -> list[Statement | Copy]:
        """The statements that insert ``rows`` (in order) on ``dialect``; ``StagingError``
        before any of them runs if one row cannot go in (a MySQL stream key too long).
        ``copy``: the driver can run a ``Copy`` (psycopg 3), so many rows may go by COPY.
        ``simple``: the driver prepares nothing and can run a ``simple`` statement.
        ``notify``: wake an idle relay on PostgreSQL (False: it wakes by ``log`` or ``poll``).
        Each database's statements live in a module of its own: ``router.write.postgres``,
        ``router.write.mysql``, ``router.write.sqlite``."""
        if dialect == "postgresql":
            return self._postgres.statements(rows, copy=copy, simple=simple, notify=notify)
        if dialect == "mysql":
            return [*mysql_statements(rows)]
        return [*self._sqlite.statements(rows)]

    def _resolve(self, database: str, spec: EventSpec) -> list[Route]:
        route = EventRoute(spec.type, spec.version, self.config.service, spec.destination)
        routes = []
        for name, broker in self.config.brokers_of(database).items():
            if not broker.wants(spec.type, published=spec.published):
                continue
            pinned = broker.versions.get(spec.type)
            target = route
            if pinned is not None and pinned != spec.version:
                check_pin(spec, name, pinned)
                # It receives the pinned version, so {version} in its template is that one.
                target = EventRoute(spec.type, pinned, self.config.service, spec.destination)
            try:
                routes.append(Route(name, broker.destination_for(target)))
            except ValueError as exc:
                raise StagingError(
                    f"event {spec.type!r} cannot go to broker {name!r}: {exc}"
                ) from None
        if not routes:
            reason = (
                "no broker in this database takes it"
                if spec.published
                else "it is not published and this database has no internal broker"
            )
            raise StagingError(f"event {spec.type!r} has no target: {reason}")
        return routes

    def _envelope(
        self,
        event: Event,
        spec: EventSpec,
        message_id: str,
        stream_key: str | None,
        now: datetime,
        options: StageOptions,
    ) -> bytes:
        payload = _payload(event, spec)
        try:
            return make_internal_envelope(
                message_id=message_id,
                event_type=spec.type,
                version=spec.version,
                time=now,
                source=self.config.service,
                payload_json=payload,
                stream=stream_key,
                event_class=spec.class_path,
                **options,
            )
        except EnvelopeError as exc:
            raise StagingError(str(exc)) from None


_Plan = tuple[EventSpec, tuple[tuple[str, str], ...], EnvelopeTemplate | None]
"""An event class in a database, for ``Stager._one``: its spec, its (target, destination)
pairs, and its envelope's template."""


def _payload(event: Event, spec: EventSpec) -> bytes:
    """The event's JSON, as pydantic writes it; StagingError if JSON cannot hold it as it is."""
    try:
        payload = event.model_dump_json().encode()
    except (PydanticSerializationError, ValueError, TypeError) as exc:
        raise StagingError(f"event {spec.type!r} cannot be serialised: {exc}") from None
    problem = json_problem(event, "payload")
    if problem is not None:
        raise StagingError(f"event {spec.type!r} cannot be serialised: {problem}")
    return payload


def _too_large(spec: EventSpec, envelope: bytes, limit: int) -> str:
    return (
        f"event {spec.type!r} is {len(envelope):,} bytes as an envelope; "
        f"the limit (outbox.max_payload_bytes) is {limit:,}"
    )


# Checks types as mypy would: no coercion ("5" is not an int, b"x" not a string).
_STAGE_OPTIONS = TypeAdapter(StageOptions)
_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "bool_type": "a boolean",
    "dict_type": "a mapping",
}


def _check_options(stream_key: object, options: Mapping[str, Any]) -> None:
    """Raise StagingError for a metadata value of the wrong type, TypeError for an unknown
    keyword (as Python would for a declared parameter)."""
    for name in options.keys() - StageOptions.__optional_keys__:
        raise TypeError(f"stage() got an unexpected keyword argument {name!r}")
    headers = options.get("headers")
    for name, value in headers.items() if isinstance(headers, Mapping) else ():
        if not isinstance(name, str) or not isinstance(value, str):
            raise StagingError(f"header {name!r}: header names and values must be strings")
    if stream_key is not None and not isinstance(stream_key, str):
        raise StagingError(f"stream_key must be a string, got {type(stream_key).__name__}")
    if not options:
        return
    # Strict mode takes only dicts for mappings; any Mapping is a valid argument.
    plain = {k: dict(v) if isinstance(v, Mapping) else v for k, v in options.items()}
    try:
        _STAGE_OPTIONS.validate_python(plain, strict=True)
    except ValidationError as exc:
        error = exc.errors()[0]
        place = str(error["loc"][0]) + "".join(f"[{part!r}]" for part in error["loc"][1:])
        expected = _EXPECTED.get(error["type"], error["msg"].lower())
        got = type(error["input"]).__name__
        raise StagingError(f"{place} must be {expected}, got {got}") from None


# The metadata a context may set on every stage() call, all text that travels as a header.
_TextId = Literal["correlation_id", "causation_id", "traceparent"]
_TEXT_IDS: tuple[_TextId, ...] = ("correlation_id", "causation_id", "traceparent")


def _only_text_ids(stream_key: object, options: Mapping[str, Any]) -> bool:
    """True when ``stream_key`` is None or a str and ``options`` holds only ``_TEXT_IDS``,
    each a str: what ``_check_options`` would pass without a word (as its strict validation
    passes a str for ``str | None``)."""
    if stream_key is not None and type(stream_key) is not str:
        return False
    for name, value in options.items():
        if type(value) is not str or name not in _TEXT_IDS:
            return False
    return True


def _check_texts(
    stream_key: str | None, stream_keys: Sequence[str | None] | None, options: StageOptions
) -> None:
    """Refuse a NUL character where text goes into a text column or a transport header."""
    check_no_nul(stream_key, "stream_key")
    for i, key in enumerate(stream_keys or ()):
        check_no_nul(key, f"stream_keys[{i}]")
    for name in _TEXT_IDS:
        value = options.get(name)
        check_no_nul(value if isinstance(value, str) else None, name)
    for header, value in (options.get("headers") or {}).items():
        check_no_nul(header, "header")
        check_no_nul(value, f"header {header!r} value")


def _keys_per_event(
    stream_key: str | None, keys: Sequence[str | None] | None, count: int
) -> Sequence[str | None]:
    """The stream key of each event: ``stream_keys`` as given, or ``stream_key`` for all."""
    if keys is None:
        return [stream_key] * count
    if stream_key is not None:
        raise StagingError(
            "pass stream_key (one key for every event) or stream_keys (one per event), not both"
        )
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise StagingError(
            f"stream_keys must be a list with one key (or None) per event, "
            f"got {type(keys).__name__}"
        )
    if len(keys) != count:
        raise StagingError(
            f"stream_keys has length {len(keys):,} for {count:,} events; "
            "pass one key (or None) per event"
        )
    for i, key in enumerate(keys):
        if key is not None and not isinstance(key, str):
            raise StagingError(f"stream_keys[{i}] must be a string, got {type(key).__name__}")
    return keys
