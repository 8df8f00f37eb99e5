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

from router.write.drivers import pyformat
from router.write.staging import Row, Stager

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
        "unnest, binary arrays": psycopg_unnest(UNNEST_BINARY),
        "unnest, text arrays": psycopg_unnest(UNNEST_TEXT),
    },
    ("django", False): {
        "VALUES, Django cursor": django_values,
        "VALUES, prepared, psycopg cursor": django_values_prepared,
    },
    ("django", True): {
        "COPY, Django cursor": django_copy,
        "unnest, Django cursor": django_unnest,
        "unnest, binary arrays, psycopg cursor": django_unnest_binary,
    },
}
"""The hand-written inserts, by (driver, bulk case): each takes the driver's connection and
the rows the router's stager built."""


def steps(driver: str, stager: Stager, bulk: bool) -> dict[str, HandInsert]:
    """From stage() to the hand inserts (of the bulk case's or not), one piece off at a time.

    stage()'s own statement as its driver sends it (without the writer's checks and option
    handling around it); with its SQL converted to ``%(name)s`` once instead of per call;
    (Django: on a server-binding psycopg cursor, so prepared from its 6th run, instead of
    Django's client-binding one;) with binary arrays; without the locks and the NOTIFY (a
    plain unnest insert of binary arrays); and the hand inserts.
    """

    def statement(rows: Sequence[Row]) -> tuple[str, dict[str, Any]]:
        (first,) = stager.statements("postgresql", rows)
        assert isinstance(first.params, dict)
        return first.sql, first.params

    def as_driver(conn: Any, rows: Sequence[Row]) -> None:
        sql, params = statement(rows)
        with conn.cursor() as cursor:
            cursor.execute(pyformat(sql), params)

    def converted_once(conn: Any, rows: Sequence[Row]) -> None:
        sql, params = statement(rows)
        with conn.cursor() as cursor:
            cursor.execute(_pyformat(sql), params)

    def server_binding(conn: Any, rows: Sequence[Row]) -> None:
        sql, params = statement(rows)
        with psycopg.Cursor(_raw(conn)) as cursor:
            cursor.execute(_pyformat(sql), params)

    def binary(conn: Any, rows: Sequence[Row]) -> None:
        sql, params = statement(rows)
        with psycopg.Cursor(_raw(conn)) as cursor:
            cursor.execute(_binary(sql), params)

    def plain(conn: Any, rows: Sequence[Row]) -> None:
        with psycopg.Cursor(_raw(conn)) as cursor:
            cursor.execute(UNNEST_BINARY, columns(rows))

    ladder: dict[str, HandInsert] = {
        "stage()'s statement, as its driver sends it": as_driver,
        "... its SQL converted once": converted_once,
    }
    if driver == "django":
        ladder["... on a server-binding psycopg cursor, prepared"] = server_binding
    ladder["... binary arrays"] = binary
    ladder["... no locks, no NOTIFY (unnest, binary arrays)"] = plain
    for name, insert in HAND[(driver, bulk)].items():
        ladder[f"hand: {name}"] = insert
    return ladder


_pyformat = functools.cache(pyformat)


@functools.cache
def _binary(sql: str) -> str:
    """stage()'s SQL with every parameter sent in binary (``%(name)b``)."""
    return re.sub(r"%\((\w+)\)s", r"%(\1)b", pyformat(sql))


def _raw(conn: Any) -> psycopg.Connection[Any]:
    """The psycopg connection: itself, or Django's underneath."""
    return conn if isinstance(conn, psycopg.Connection) else conn.connection
