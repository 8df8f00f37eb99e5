"""The write path: turn events into outbox rows inside the caller's transaction.

One event becomes one row per target: the internal broker always, and every external broker
whose filter takes it when the event is ``published``. All rows of one ``stage()`` call go in
with one INSERT; on PostgreSQL the same statement sends ``NOTIFY router_outbox`` (delivered by
PostgreSQL only if the caller commits). Anything that would make a row undeliverable (a
payload that does not serialise, an envelope over the size limit, an event no broker takes, a
destination a broker cannot accept) raises ``StagingError`` before anything is written.

Each event has one stream key: ``stream_key`` gives every event of the call the same one,
``stream_keys`` one per event, so a batch over many streams is still one INSERT; rows go in
the order of the events, so per stream key, seq follows the order given.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, Unpack

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from brokers import EventRoute
from envelopes import (
    EnvelopeError,
    StageOptions,
    StagingError,
    check_cloudevents_extensions,
    make_internal_envelope,
    uuid7_text,
)
from router._db import sqlite_time
from router._wakeup import WAKE_LOCK_NAMESPACE
from router.config import RouterConfig
from router.write.checks import check_no_nul, json_problem
from router.write.events import Event, EventSpec
from router.write.mysql import mysql_statements
from router.write.pinning import check_pin
from router.write.statements import Copy, Row, Statement, clause

__all__ = ["Copy", "Route", "Row", "Stager", "Statement", "clause"]

_COLUMNS = "message_id, target, destination, event_type, stream_key, envelope"

# Per-stream commit order on PostgreSQL: before any row gets its seq, the transaction takes
# a transaction-scoped advisory lock on each of its stream keys' slots (in slot order, so two
# stagers never wait on each other in a cycle). A second transaction staging on the same key
# waits until the first commits or rolls back, so per stream key, seq order is commit order,
# and a later row can never become visible while an earlier one is still in flight. The
# scalar subquery is an InitPlan: it runs before the first row reaches the INSERT, i.e.
# before any seq is drawn.
#
# A key's lock is its slot, ``hashtext(key) & (STREAM_LOCK_SLOTS - 1)``, the same in every
# statement (one key or 20,000), so every transaction on a key takes the same lock. A lock
# per key would take one entry of PostgreSQL's shared lock table per key, and the table holds
# max_locks_per_transaction x max_connections for the whole server (6,400 by default): about
# 6,000 keys in one transaction ended it with "out of shared memory", and any other session
# needing a lock meanwhile with it. With slots, a transaction holds at most 1,024 however
# many keys it stages, in one call or in a loop of calls; five such at once fit the default
# table. The price: two transactions on unrelated keys of one slot take turns, as if they
# shared a key: with N stagers in flight at once, each waits on an unrelated one with odds
# about (N - 1) / 1,024. 4,096 slots would make that a quarter, but two large transactions
# at once would fill the default table. The one-event path keeps its one statement and one
# lock; it adds an integer AND, tens of nanoseconds of a transaction's 600 us or so (4
# million of them took no longer than as many casts to bigint; 2,000 one-event stage()
# transactions, the two forms taking turns, differed by less than the machine's noise).
# The keys come distinct (``_stream_keys``); two of one slot take its lock twice in a row,
# which a transaction's advisory lock allows (the second is a lookup in the backend's own
# table), so no DISTINCT (a fifth of the statement's time over 1,000 keys).
STREAM_LOCK_SLOTS = 1024
"""Advisory locks per-stream order uses on PostgreSQL: a key locks ``hashtext(key) & 1023``."""
_SLOT = f"hashtext({{key}}) & {STREAM_LOCK_SLOTS - 1}"
_STREAM_LOCKS = f"""(
    SELECT count(pg_advisory_xact_lock({{namespace}}, h))
    FROM (SELECT {_SLOT.format(key="k")} AS h FROM unnest({{keys}}) AS k ORDER BY h) AS keys
) >= 0"""
STREAM_LOCK_NAMESPACE = 1869903202
"""First key of the stream slots' advisory locks (the second is the slot)."""

# Waking the relay on PostgreSQL, with nothing on the commit path while a relay is busy (see
# "Waking the relay" in docs/architecture.md). A NOTIFY makes its transaction take an
# instance-wide lock at COMMIT, held until the commit record is flushed, so notifying
# transactions commit one at a time: with 4+ writers, 0.4x a hand-written outbox. So a
# transaction notifies only when a relay needs it: a relay that is idle and listening holds
# its target's wake lock exclusively (a session advisory lock); a stager tries that lock
# shared for each of its targets, and notifies only when a try fails. A busy relay holds no
# wake lock: the try succeeds, nothing is queued, and the relay's next claim finds the rows.
# The shared lock lasts until the stager's transaction ends, so a relay going idle cannot
# take its wake lock (and look once more) before the rows it did not hear of are committed.
_WAKE_TRY = f"pg_try_advisory_xact_lock_shared({WAKE_LOCK_NAMESPACE}, hashtext({{target}}))"
_WAKE_ANY = (
    f"(SELECT bool_and({_WAKE_TRY.format(target='w')}) "
    "FROM unnest(string_to_array({notify}, ',')) AS w)"
)


def _wake(notify: str, gate: str) -> str:
    """Notify ``notify`` (the targets) unless ``gate`` (their wake locks, tried shared) held."""
    return f"CASE WHEN {gate} THEN NULL ELSE pg_notify('router_outbox', {notify}) END"


def _wake_many(notify: str) -> str:
    """``_wake`` for the targets listed in ``notify`` (``a,b,c``), one try each."""
    typed = f"CAST({notify} AS text)"  # a parameter's type, which asyncpg cannot infer here
    return _wake(typed, _WAKE_ANY.format(notify=typed))


# Many rows at once: every column an array, unnested, after the stream keys' locks. Written
# with named parameters, as SQLAlchemy's text() and the DB-API drivers take them (``:name`` or
# ``%(name)s``, ``Statement``); asyncpg gets them numbered (``_numbered``).
_PG_INSERT_NAMED = f"""
WITH inserted AS (
    INSERT INTO router_outbox ({_COLUMNS})
    SELECT * FROM unnest(
        CAST(:ids AS uuid[]), CAST(:targets AS text[]), CAST(:destinations AS text[]),
        CAST(:types AS text[]), CAST(:streams AS text[]), CAST(:envelopes AS json[]))
    WHERE {_STREAM_LOCKS.format(namespace=STREAM_LOCK_NAMESPACE, keys="CAST(:locks AS text[])")}
    RETURNING 1
)
SELECT {{wake}}
"""

PG_INSERT_NAMED = _PG_INSERT_NAMED.format(wake=_wake_many(":notify"))
_PG_INSERT_NAMED_QUIET = _PG_INSERT_NAMED.format(wake="1")

# A few rows on at most one stream key (one event's rows, say): a plain VALUES list, with no
# unnest, whose planning and running over six arrays cost more than the insert itself at
# this size, and no CTE. What the rows of one event share (id, type, key, envelope) is one
# parameter each, sent once however many targets. The lock and the NOTIFY are a gate: an
# uncorrelated scalar subquery in WHERE, which PostgreSQL runs once, as an InitPlan, before
# the first row reaches the INSERT (a One-Time Filter), i.e. before any seq is drawn, as
# above; volatile, their calls are never planned away.
_PG_SMALL_ROWS = 16
_PG_LOCK = f"pg_advisory_xact_lock({STREAM_LOCK_NAMESPACE}, {_SLOT.format(key=':k')})"
_PG_ROW = "(CAST(:m{j} AS uuid), :t{i}, :d{i}, :e{j}, :s{j}, CAST(:v{j} AS json))"
# The parameters of one event's own values in the small form (``_event_names(0)``) and its
# stream key's lock; the others depend only on the event's targets and destinations.
_ONE_EVENT_OWN = frozenset({"k", "m0", "e0", "s0", "v0"})


def _pg_small_insert(targets: tuple[int, ...], locked: bool, wakes: int) -> str:
    """The statement for events with ``targets[j]`` rows each, after the lock of their one
    stream key if any and the wake of their ``wakes`` targets (none: no NOTIFY)."""
    calls = _pg_gate_calls(locked, wakes)
    insert = (
        f"INSERT INTO router_outbox ({_COLUMNS}) SELECT * FROM (VALUES {_pg_rows(targets)}) AS r"
    )
    if not calls:
        return insert
    return f"{insert} WHERE (SELECT true FROM (SELECT {', '.join(calls)}) AS g)"


def _pg_gate_calls(locked: bool, wakes: int) -> list[str]:
    """What runs before the rows: the stream key's lock, then the wake of ``wakes`` targets
    (``:w0``...; their tries in one CASE, no subquery to plan)."""
    calls = [_PG_LOCK] if locked else []
    if wakes:
        tries = " AND ".join(_WAKE_TRY.format(target=f":w{n}") for n in range(wakes))
        calls.append(_wake(":notify", tries))
    return calls


def _pg_rows(targets: tuple[int, ...]) -> str:
    """The VALUES rows of events with ``targets[j]`` rows each (``_PG_ROW``)."""
    rows: list[str] = []
    i = 0
    for j, count in enumerate(targets):
        rows.extend(_PG_ROW.format(i=n, j=j) for n in range(i, i + count))
        i += count
    return ", ".join(rows)


# The same rows for a driver that binds on the client and sends a simple query, where nothing
# is ever prepared (psycopg2; psycopg 3 with preparing off, as Django's connection has it by
# default): every statement is parsed and planned on each call, and there the gate's subquery
# costs more to plan than a second statement costs to run (30-40 us of a 700 us transaction).
# So two statements in one query: the lock and the NOTIFY, then a plain INSERT ... VALUES. The
# lock is held before the INSERT, the next statement, draws its first seq.
def _pg_simple_insert(targets: tuple[int, ...], locked: bool, wakes: int) -> str:
    """``_pg_small_insert``'s rows as two statements in one simple query."""
    calls = _pg_gate_calls(locked, wakes)
    insert = f"INSERT INTO router_outbox ({_COLUMNS}) VALUES {_pg_rows(targets)}"
    return f"SELECT {', '.join(calls)}; {insert}" if calls else insert


# Many rows through a driver that can COPY (psycopg 3): one statement takes the stream keys'
# locks (as PG_INSERT_NAMED does) and queues the wake, then COPY writes the rows, the fastest way
# in. The locks are held before COPY draws the first seq; the NOTIFY, like any, is delivered
# only at COMMIT, so queued before the rows it is the same as after them. COPY pays a round
# trip of its own, so a few dozen rows go faster by unnest.
_PG_COPY_ROWS = 64
_PG_COPY_LOCKS = _STREAM_LOCKS.format(
    namespace=STREAM_LOCK_NAMESPACE, keys="CAST(:locks AS text[])"
)
PG_COPY = f"COPY router_outbox ({_COLUMNS}) FROM STDIN (FORMAT BINARY)"
# Binary COPY carries no types: the server reads each field with its column's binary input.
# A uuid's is its 16 bytes, sent as bytea; json's is its text. Both are dumped in C, where
# uuid.UUID objects would cost a parse of every id in Python (binary was 9% faster than text
# COPY for 1,000 rows by hand).
_PG_COPY_TYPES = ("bytea", "text", "text", "text", "text", "text")


_SQLITE_FIELDS = ("m", "t", "d", "e", "k", "v", "a", "c")
_SQLITE_MAX_ROWS = 1000  # stays far below SQLite's 32,766 bound variables


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
        self._sqlite_inserts: dict[int, str] = {}
        self._pg_small_inserts: dict[tuple[tuple[int, ...], bool, int, bool], str] = {}
        self._pg_one_events: dict[
            tuple[tuple[tuple[str, str], ...], bool, bool, bool], tuple[str, dict[str, Any]]
        ] = {}
        self._headers_carried: set[tuple[str, tuple[str, ...]]] = set()
        self._cloudevents: dict[str, frozenset[str]] = {}

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
            if not isinstance(event, Event):
                raise StagingError(f"stage() takes router.Event instances, got {type(event)!r}")
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
                raise StagingError(
                    f"event {spec.type!r} is {len(envelope):,} bytes as an envelope; "
                    f"the limit (outbox.max_payload_bytes) is {limit:,}"
                )
            stored = envelope.decode()
            for r in routes:
                rows.append(Row(message_id, r.target, r.destination, spec.type, key, stored))
        return rows

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

    async def insert_postgres_raw(
        self, conn: Any, rows: Sequence[Row], *, notify: bool = True
    ) -> None:
        """Insert rows through a raw asyncpg connection (caller's transaction), waking an
        idle relay unless ``notify`` is False: the statements every driver runs, numbered."""
        for statement in self.statements("postgresql", rows, notify=notify):
            assert isinstance(statement, Statement)  # no Copy unless asked for
            assert isinstance(statement.params, dict)  # PostgreSQL's are named
            sql, names = _numbered(statement.sql)
            await conn.execute(sql, *(statement.params[name] for name in names))

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
        ``notify``: wake an idle relay on PostgreSQL (False: it wakes by ``log`` or ``poll``)."""
        if dialect == "postgresql":
            one = self._pg_one_event(rows, simple, notify) if len(rows) <= _PG_SMALL_ROWS else None
            if one is not None:
                return [one]
            keys = _stream_keys(rows)
            if len(rows) <= _PG_SMALL_ROWS and len(keys) <= 1:
                return [self._pg_small(rows, keys, simple, notify)]
            targets_listed = _notify_payload(rows)
            if copy and len(rows) >= _PG_COPY_ROWS:
                calls = [_wake_many(":notify")] if notify else []
                if keys:
                    calls.append(_PG_COPY_LOCKS)
                before: list[Statement | Copy] = []
                if calls:
                    named = {"notify": targets_listed, "locks": keys}
                    before.append(Statement(f"SELECT {', '.join(calls)}", named))
                return [*before, Copy(PG_COPY, _PG_COPY_TYPES, _copy_rows(rows))]
            ids, targets, destinations, types, streams, envelopes = _columns(rows)
            params = {
                "ids": ids,
                "targets": targets,
                "destinations": destinations,
                "types": types,
                "streams": streams,
                "envelopes": envelopes,
                "notify": targets_listed,
                "locks": keys,
            }
            return [Statement(PG_INSERT_NAMED if notify else _PG_INSERT_NAMED_QUIET, params)]
        if dialect == "mysql":
            return [*mysql_statements(rows)]
        return [*self._sqlite_statements(rows)]

    async def insert_sqlalchemy(
        self, conn: Any, dialect: str, rows: Sequence[Row], *, notify: bool = True
    ) -> None:
        """Insert rows through a SQLAlchemy AsyncConnection (caller's transaction)."""
        for statement in self.statements(dialect, rows, notify=notify):
            assert isinstance(statement, Statement)  # no Copy unless asked for
            if await _run_async(conn, statement) == 0 and statement.repair is not None:
                await _run_async(conn, statement.repair)
                await _run_async(conn, statement)

    def _pg_one_event(self, rows: Sequence[Row], simple: bool, notify: bool) -> Statement | None:
        """``_pg_small``'s statement for the rows of one event (None for any other rows),
        from what it was for the first event with these targets and destinations: the text
        and every parameter but the event's id, type, stream key and envelope are the same."""
        if not rows:
            return None
        first = rows[0]
        for r in rows:
            if r.message_id != first.message_id or r.stream_key != first.stream_key:
                return None
        key = first.stream_key
        locked = key is not None
        shape = (tuple([(r.target, r.destination) for r in rows]), locked, simple, notify)
        cached = self._pg_one_events.get(shape)
        if cached is None:
            statement = self._pg_small(rows, [] if key is None else [key], simple, notify)
            assert isinstance(statement.params, dict)  # PostgreSQL's are named
            shared = {k: v for k, v in statement.params.items() if k not in _ONE_EVENT_OWN}
            if len(self._pg_one_events) < 256:  # the targets of an application's events are few
                self._pg_one_events[shape] = (statement.sql, shared)
            return statement
        sql, shared = cached
        params = shared.copy()
        if locked:
            params["k"] = key
        params["m0"], params["e0"], params["s0"], params["v0"] = (
            first.message_id,
            first.event_type,
            key,
            first.envelope,
        )
        return Statement(sql, params, simple)

    def _pg_small(
        self, rows: Sequence[Row], keys: Sequence[str], simple: bool, notify: bool
    ) -> Statement:
        params: dict[str, Any] = {}
        wakes = 0
        if notify:
            listed = sorted({r.target for r in rows})
            params["notify"] = ",".join(listed)
            params.update(zip(_wake_names(len(listed)), listed, strict=True))
            wakes = len(listed)
        if keys:
            params["k"] = keys[0]
        targets: list[int] = []
        for i, r in enumerate(rows):
            names = _row_names(i)
            params[names[0]], params[names[1]] = r.target, r.destination
            # An event's rows are together, in order (build_rows): a new id starts the next.
            if i == 0 or r.message_id != rows[i - 1].message_id:
                m, e, s, v = _event_names(len(targets))
                params[m], params[e], params[s], params[v] = (
                    r.message_id,
                    r.event_type,
                    r.stream_key,
                    r.envelope,
                )
                targets.append(0)
            targets[-1] += 1
        shape = (tuple(targets), bool(keys), wakes, simple)
        sql = self._pg_small_inserts.get(shape)
        if sql is None:
            sql = (_pg_simple_insert if simple else _pg_small_insert)(*shape[:3])
            if len(self._pg_small_inserts) < 256:  # the shapes an application uses are few
                self._pg_small_inserts[shape] = sql
        return Statement(sql, params, simple)

    def _sqlite_statements(self, rows: Sequence[Row]) -> list[Statement]:
        stamp = sqlite_time(datetime.now(UTC))
        statements = []
        for start in range(0, len(rows), _SQLITE_MAX_ROWS):
            chunk = rows[start : start + _SQLITE_MAX_ROWS]
            params: dict[str, Any] = {}
            for i, row in enumerate(chunk):
                values = (
                    row.message_id,
                    row.target,
                    row.destination,
                    row.event_type,
                    row.stream_key,
                    row.envelope,
                    stamp,
                    stamp,
                )
                params.update({f"{f}{i}": v for f, v in zip(_SQLITE_FIELDS, values, strict=True)})
            statements.append(Statement(self._sqlite_insert(len(chunk)), params))
        return statements

    def _sqlite_insert(self, count: int) -> str:
        statement = self._sqlite_inserts.get(count)
        if statement is None:
            values = ", ".join(
                "(" + ", ".join(f":{f}{i}" for f in _SQLITE_FIELDS) + ")" for i in range(count)
            )
            statement = (
                f"INSERT INTO router_outbox ({_COLUMNS}, available_at, created_at) VALUES {values}"
            )
            if len(self._sqlite_inserts) < 256:
                self._sqlite_inserts[count] = statement
        return statement

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
        try:
            payload = event.model_dump_json().encode()
        except (PydanticSerializationError, ValueError, TypeError) as exc:
            raise StagingError(f"event {spec.type!r} cannot be serialised: {exc}") from None
        problem = json_problem(event, "payload")
        if problem is not None:
            raise StagingError(f"event {spec.type!r} cannot be serialised: {problem}")
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


async def _run_async(conn: Any, statement: Statement) -> int:
    """Run one statement on a SQLAlchemy AsyncConnection; the rows it wrote."""
    if statement.named:
        result = await conn.execute(clause(statement.sql), statement.params)
    else:
        result = await conn.exec_driver_sql(statement.sql, statement.params)
    return int(result.rowcount)


def _columns(
    rows: Sequence[Row],
) -> tuple[list[str], list[str], list[str], list[str], list[str | None], list[str]]:
    return (
        [r.message_id for r in rows],
        [r.target for r in rows],
        [r.destination for r in rows],
        [r.event_type for r in rows],
        [r.stream_key for r in rows],
        [r.envelope for r in rows],
    )


@functools.cache
def _row_names(i: int) -> tuple[str, str]:
    """The parameters of row ``i``'s target and destination in the small form."""
    return f"t{i}", f"d{i}"


_NAMED = re.compile(r"(?<![:\w]):([a-z]\w*)")


@functools.lru_cache(maxsize=512)
def _numbered(sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql``'s ``:name`` parameters as asyncpg's ``$1, $2...``, and the names in that order
    (a name used twice keeps its one number). Once per statement text: the texts are few."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return _NAMED.sub(number, sql), tuple(names)


@functools.cache
def _wake_names(count: int) -> tuple[str, ...]:
    """The parameters of the small form's ``count`` targets to wake, in their tries."""
    return tuple(f"w{n}" for n in range(count))


@functools.cache
def _event_names(j: int) -> tuple[str, str, str, str]:
    """The parameters of event ``j``'s id, type, stream key and envelope in the small form."""
    return f"m{j}", f"e{j}", f"s{j}", f"v{j}"


def _copy_rows(rows: Sequence[Row]) -> list[tuple[bytes | str | None, ...]]:
    """The rows as ``Copy`` sends them: an id as its 16 bytes, a uuid's binary form."""
    return [
        (
            bytes.fromhex(r.message_id.replace("-", "")),
            r.target,
            r.destination,
            r.event_type,
            r.stream_key,
            r.envelope,
        )
        for r in rows
    ]


def _stream_keys(rows: Sequence[Row]) -> list[str]:
    return sorted({r.stream_key for r in rows if r.stream_key is not None})


def _notify_payload(rows: Sequence[Row]) -> str:
    return ",".join(sorted({r.target for r in rows}))
