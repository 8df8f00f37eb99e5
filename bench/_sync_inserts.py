"""The hand-written inserts ``bench.stage_sync`` measures stage() against, and the steps
from one to the other that ``--profile`` times.

Each takes the driver's connection, inside the transaction, and the rows the router's own
stager built, and writes them as they are. None takes a stream-key lock or sends a NOTIFY.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from router.write.drivers import SyncDriver, sync_driver
from router.write.staging import Copy, Row, Stager, Statement

HandInsert = Callable[[Any, Sequence[Row]], None]
"""Writes the rows on the connection (a psycopg connection, or Django's)."""

COLUMNS = "message_id, target, destination, event_type, stream_key, envelope"
FIELDS = ("message_id", "target", "destination", "event_type", "stream_key", "envelope")
UNNEST = (
    f"INSERT INTO router_outbox ({COLUMNS}) SELECT * FROM unnest({{p}}::uuid[], {{p}}::text[], "
    "{p}::text[], {p}::text[], {p}::text[], {p}::json[])"
)
UNNEST_TEXT = UNNEST.format(p="%s")
# %b: each list goes as a binary text[] (cast on the server), which psycopg dumps in C; a text
# array of JSON strings is escaped in Python, quote by quote (see the profile).
UNNEST_BINARY = UNNEST.format(p="%b")
COPY = f"COPY router_outbox ({COLUMNS}) FROM STDIN"
COPY_BINARY = f"COPY router_outbox ({COLUMNS}) FROM STDIN (FORMAT BINARY)"
# In binary COPY a uuid is its 16 bytes and json its text: sent as bytea and text, psycopg
# dumps them in C, where uuid.UUID objects would cost a parse of each id in Python first.
BINARY_TYPES = ["bytea", "text", "text", "text", "text", "text"]


@functools.cache
def values_insert(count: int) -> str:
    """A plain ``INSERT ... VALUES`` of ``count`` rows, positional parameters."""
    row = "(%s::uuid, %s, %s, %s, %s, %s::json)"
    return f"INSERT INTO router_outbox ({COLUMNS}) VALUES " + ", ".join([row] * count)


def flat(rows: Sequence[Row]) -> tuple[Any, ...]:
    """The rows' values, row after row."""
    return tuple(getattr(r, name) for r in rows for name in FIELDS)


def columns(rows: Sequence[Row]) -> list[list[Any]]:
    """One list per column."""
    return [[getattr(r, name) for r in rows] for name in FIELDS]


def copy_rows(cursor: Any, rows: Sequence[Row]) -> None:
    """``COPY ... FROM STDIN`` (text format) on a psycopg cursor."""
    with cursor.copy(COPY) as copy:
        for r in rows:
            copy.write_row(
                (r.message_id, r.target, r.destination, r.event_type, r.stream_key, r.envelope)
            )


def copy_binary_rows(cursor: Any, rows: Sequence[Row]) -> None:
    """``COPY ... FROM STDIN (FORMAT BINARY)`` on a psycopg cursor."""
    with cursor.copy(COPY_BINARY) as copy:
        copy.set_types(BINARY_TYPES)
        for r in rows:
            uuid = bytes.fromhex(r.message_id.replace("-", ""))
            copy.write_row((uuid, r.target, r.destination, r.event_type, r.stream_key, r.envelope))


def psycopg_values(prepare: bool | None) -> HandInsert:
    """VALUES on the connection; ``prepare=None`` is psycopg's default, which prepares a
    statement from its 6th run on (``prepare_threshold=5``)."""

    def insert(conn: psycopg.Connection[Any], rows: Sequence[Row]) -> None:
        conn.execute(values_insert(len(rows)), flat(rows), prepare=prepare)

    return insert


def psycopg_unnest(query: str) -> HandInsert:
    """One ``INSERT ... SELECT * FROM unnest(...)``, one array per column."""

    def insert(conn: psycopg.Connection[Any], rows: Sequence[Row]) -> None:
        conn.execute(query, columns(rows))

    return insert


def psycopg_copy(conn: psycopg.Connection[Any], rows: Sequence[Row]) -> None:
    """COPY on a cursor of the connection."""
    with conn.cursor() as cursor:
        copy_rows(cursor, rows)


def psycopg_copy_binary(conn: psycopg.Connection[Any], rows: Sequence[Row]) -> None:
    """Binary COPY on a cursor of the connection."""
    with conn.cursor() as cursor:
        copy_binary_rows(cursor, rows)


def django_values(connection: Any, rows: Sequence[Row]) -> None:
    """VALUES on Django's cursor (client-side binding: the values are quoted in the SQL)."""
    with connection.cursor() as cursor:
        cursor.execute(values_insert(len(rows)), flat(rows))


def django_values_prepared(connection: Any, rows: Sequence[Row]) -> None:
    """VALUES, prepared, on a server-binding psycopg cursor of Django's own connection (it
    prepares only with a ``prepare_threshold``, which Django sets to None unless OPTIONS
    give one)."""
    with psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(values_insert(len(rows)), flat(rows), prepare=True)


def django_copy(connection: Any, rows: Sequence[Row]) -> None:
    """COPY on Django's cursor (its wrapper hands ``copy`` to psycopg's cursor)."""
    with connection.cursor() as cursor:
        copy_rows(cursor, rows)


def django_copy_binary(connection: Any, rows: Sequence[Row]) -> None:
    """Binary COPY on Django's cursor."""
    with connection.cursor() as cursor:
        copy_binary_rows(cursor, rows)


def django_unnest(connection: Any, rows: Sequence[Row]) -> None:
    """unnest() on Django's cursor (the arrays quoted client-side)."""
    with connection.cursor() as cursor:
        cursor.execute(UNNEST_TEXT, columns(rows))


def django_unnest_binary(connection: Any, rows: Sequence[Row]) -> None:
    """unnest() of binary arrays on a server-binding psycopg cursor of Django's connection."""
    with psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(UNNEST_BINARY, columns(rows))


HAND: dict[tuple[str, bool], dict[str, HandInsert]] = {
    ("psycopg", False): {
        "VALUES, prepare=True": psycopg_values(True),
        "VALUES, default (prepared from the 6th)": psycopg_values(None),
        "VALUES, prepare=False": psycopg_values(False),
    },
    ("psycopg", True): {
        "COPY": psycopg_copy,
        "COPY, binary": psycopg_copy_binary,
        "unnest, binary arrays": psycopg_unnest(UNNEST_BINARY),
        "unnest, text arrays": psycopg_unnest(UNNEST_TEXT),
    },
    ("django", False): {
        "VALUES, Django cursor": django_values,
        "VALUES, prepared, psycopg cursor": django_values_prepared,
    },
    ("django", True): {
        "COPY, Django cursor": django_copy,
        "COPY, binary, Django cursor": django_copy_binary,
        "unnest, Django cursor": django_unnest,
        "unnest, binary arrays, psycopg cursor": django_unnest_binary,
    },
    # Django's own settings: psycopg's preparing off (prepare_threshold None), so the psycopg
    # cursor's statement is not prepared either, as stage()'s is not.
    ("django-default", False): {
        "VALUES, Django cursor": django_values,
        "VALUES, psycopg cursor (not prepared)": django_values_prepared,
    },
}
HAND[("django-default", True)] = HAND[("django", True)]
"""The hand-written inserts, by (driver, bulk case): each takes the driver's connection and
the rows the router's stager built."""


def steps(driver: str, stager: Stager, bulk: bool) -> dict[str, HandInsert]:
    """From stage() to the hand inserts (of the bulk case's or not), one piece off at a time.

    stage()'s own statements as its driver runs them (without the writer's checks and option
    handling around them); without the stream-key locks; without the NOTIFY too (for the
    bulk: its COPY alone); and the hand inserts.
    """

    def statements(run: SyncDriver, rows: Sequence[Row]) -> list[Statement | Copy]:
        return stager.statements("postgresql", rows, copy=run.copies, simple=run.simple)

    def as_driver(conn: Any, rows: Sequence[Row]) -> None:
        run = sync_driver(conn)
        for statement in statements(run, rows):
            run.execute(statement)

    def without(conn: Any, rows: Sequence[Row], notify: bool) -> None:
        run = sync_driver(conn)
        for statement in statements(run, rows):
            if isinstance(statement, Statement) and "pg_advisory_xact_lock" in statement.sql:
                sql = _unlocked(statement.sql, notify)
                if sql is None:  # the bulk's locks (and NOTIFY): COPY alone
                    continue
                statement = Statement(sql, statement.params, statement.simple)
            run.execute(statement)

    ladder: dict[str, HandInsert] = {
        "stage()'s statements, as its driver runs them": as_driver,
        "... no stream-key lock": functools.partial(without, notify=True),
        "... no NOTIFY either": functools.partial(without, notify=False),
    }
    for name, insert in HAND[(driver, bulk)].items():
        ladder[f"hand: {name}"] = insert
    return ladder


_LOCK = re.compile(r"pg_advisory_xact_lock\(\d+, hashtext\(:k\) & \d+\)(?: AS held)?, ")
_NOTIFY = "SELECT pg_notify('router_outbox', :notify)"


def _unlocked(sql: str, notify: bool) -> str | None:
    """stage()'s statement without its locks (and its NOTIFY unless ``notify``); None for
    nothing left to run."""
    if sql.startswith("SELECT pg_advisory_xact_lock"):  # the simple form: two statements
        return _LOCK.sub("", sql) if notify else sql.partition("; ")[2]
    if not _LOCK.search(sql):  # the bulk's statement of locks and NOTIFY
        return _NOTIFY if notify else None
    if not notify:  # the small form without its gate: a plain insert
        return sql.partition(" WHERE (SELECT true FROM")[0]
    return _LOCK.sub("", sql)
