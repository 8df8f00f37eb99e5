"""The hand-written inserts ``bench.stage_sync`` measures stage() against, and the steps
from one to the other that ``--profile`` times.

A hand insert writes what a team's own outbox holds (``bench._writers``' hand outbox: uuid,
target, type, key, jsonb payload, created_at, published_at; a partial index on the pending
rows): per event and target, a uuid4 and the event's JSON (``hand_row``), in one statement,
prepared where the driver can. Each takes the driver's connection, inside the transaction. None
takes a stream-key lock or sends a NOTIFY. The steps take stage()'s own statements apart, on
the rows the router's stager builds, into ``router_outbox``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from bench._writers import HandRow, hand_insert
from router.write.drivers import SyncDriver, sync_driver
from router.write.staging import Copy, Row, Stager, Statement

HandInsert = Callable[[Any, Sequence[HandRow]], None]
"""Writes hand outbox rows on the connection (a psycopg connection, or Django's)."""

Step = Callable[[Any, Sequence[Row]], None]
"""Writes the router's rows on the connection, one piece of stage() at a time."""

UNNEST = (
    "INSERT INTO hand_outbox (id, target, type, key, payload) SELECT * FROM "
    "unnest({p}::uuid[], {p}::text[], {p}::text[], {p}::text[], {p}::jsonb[])"
)
UNNEST_TEXT = UNNEST.format(p="%s")
# %b: each list goes as a binary array (the payloads a text[], cast on the server), which
# psycopg dumps in C; a text array of JSON strings is escaped in Python, quote by quote.
UNNEST_BINARY = UNNEST.format(p="%b")
COPY = "COPY hand_outbox (id, target, type, key, payload) FROM STDIN"


def flat(rows: Sequence[HandRow]) -> tuple[Any, ...]:
    """The rows' values, row after row."""
    return tuple(value for row in rows for value in row)


def columns(rows: Sequence[HandRow]) -> list[list[Any]]:
    """One list per column."""
    return [list(column) for column in zip(*rows, strict=True)]


def copy_rows(cursor: Any, rows: Sequence[HandRow]) -> None:
    """``COPY ... FROM STDIN`` (text format) on a psycopg cursor."""
    with cursor.copy(COPY) as copy:
        for row in rows:
            copy.write_row(row)


def psycopg_values(conn: psycopg.Connection[Any], rows: Sequence[HandRow]) -> None:
    """``INSERT ... VALUES``, prepared (``prepare=True``: from its first run)."""
    conn.execute(hand_insert(len(rows)), flat(rows), prepare=True)


def psycopg_unnest(query: str) -> HandInsert:
    """One ``INSERT ... SELECT * FROM unnest(...)``, one array per column, prepared."""

    def insert(conn: psycopg.Connection[Any], rows: Sequence[HandRow]) -> None:
        conn.execute(query, columns(rows), prepare=True)

    return insert


def psycopg_copy(conn: psycopg.Connection[Any], rows: Sequence[HandRow]) -> None:
    """COPY on a cursor of the connection."""
    with conn.cursor() as cursor:
        copy_rows(cursor, rows)


def django_values(connection: Any, rows: Sequence[HandRow]) -> None:
    """VALUES on Django's cursor (client-side binding: the values are quoted in the SQL)."""
    with connection.cursor() as cursor:
        cursor.execute(hand_insert(len(rows)), flat(rows))


def django_values_prepared(connection: Any, rows: Sequence[HandRow]) -> None:
    """VALUES, prepared, on a server-binding psycopg cursor of Django's own connection (it
    prepares only with a ``prepare_threshold``, which Django sets to None unless OPTIONS
    give one)."""
    with psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(hand_insert(len(rows)), flat(rows), prepare=True)


def django_copy(connection: Any, rows: Sequence[HandRow]) -> None:
    """COPY on Django's cursor (its wrapper hands ``copy`` to psycopg's cursor)."""
    with connection.cursor() as cursor:
        copy_rows(cursor, rows)


def django_unnest(connection: Any, rows: Sequence[HandRow]) -> None:
    """unnest() on Django's cursor (the arrays quoted client-side)."""
    with connection.cursor() as cursor:
        cursor.execute(UNNEST_TEXT, columns(rows))


def django_unnest_binary(connection: Any, rows: Sequence[HandRow]) -> None:
    """unnest() of binary arrays, prepared, on a server-binding psycopg cursor of Django's
    connection."""
    with psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(UNNEST_BINARY, columns(rows), prepare=True)


HAND: dict[tuple[str, bool], dict[str, HandInsert]] = {
    ("psycopg", False): {"VALUES, prepared": psycopg_values},
    # COPY is no prepared statement, but stage() itself sends 64 rows or more by COPY: a
    # baseline without it could be the weaker.
    ("psycopg", True): {
        "unnest, binary arrays, prepared": psycopg_unnest(UNNEST_BINARY),
        "unnest, text arrays, prepared": psycopg_unnest(UNNEST_TEXT),
        "COPY": psycopg_copy,
    },
    ("django", False): {
        "VALUES, Django cursor": django_values,
        "VALUES, prepared, psycopg cursor": django_values_prepared,
    },
    ("django", True): {
        "COPY, Django cursor": django_copy,
        "unnest, Django cursor": django_unnest,
        "unnest, binary arrays, prepared, psycopg cursor": django_unnest_binary,
    },
    # Django's own settings: psycopg's preparing off (prepare_threshold None), so the psycopg
    # cursor's statement is not prepared either, as stage()'s is not.
    ("django-default", False): {
        "VALUES, Django cursor": django_values,
        "VALUES, psycopg cursor (not prepared)": django_values_prepared,
    },
    ("django-default", True): {
        "COPY, Django cursor": django_copy,
        "unnest, Django cursor": django_unnest,
        "unnest, binary arrays, psycopg cursor (not prepared)": django_unnest_binary,
    },
}
"""The hand-written inserts, by (driver, bulk case): each takes the driver's connection and
the hand outbox rows."""


def steps(stager: Stager) -> dict[str, Step]:
    """stage()'s statement, one piece off at a time, towards the hand inserts.

    stage()'s own statements as its driver runs them (without the writer's checks and option
    handling around them); without the stream-key locks; without the NOTIFY too (for the
    bulk: its COPY alone). All write the router's rows into ``router_outbox``.
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

    return {
        "stage()'s statements, as its driver runs them": as_driver,
        "... no stream-key lock": functools.partial(without, notify=True),
        "... no NOTIFY either": functools.partial(without, notify=False),
    }


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
