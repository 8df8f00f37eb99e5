"""The statements ``stage()`` runs, as every driver takes them: the rows, a statement with
its parameters, a binary COPY. Built by ``router.write.postgres``, ``mysql`` and ``sqlite``,
run by the drivers (``router.write.drivers``, ``router.write.async_drivers``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy import TextClause

__all__ = ["Copy", "Row", "Statement", "clause"]


# Not frozen: a frozen dataclass sets each field through object.__setattr__, 1.5 us more per
# row on stage()'s path, a tenth of the call. Nothing changes a Row once made.
@dataclass(slots=True)
class Row:
    """One outbox row to insert."""

    message_id: str
    target: str
    destination: str
    event_type: str
    stream_key: str | None
    envelope: str
    xid: int | None = None
    """MySQL/MariaDB and SQLite, a row of an atomic target: its transaction's token
    (``router.write.units``); None elsewhere (PostgreSQL records the transaction itself)."""


@dataclass(frozen=True, slots=True)
class Copy:
    """Rows to write with ``COPY ... FROM STDIN`` (``sql``, binary format), each a tuple of
    the columns, their wire types ``types``."""

    sql: str
    types: tuple[str, ...]
    rows: list[tuple[bytes | str | None, ...]]


# Not frozen, as Row: 0.8 us more per stage() call. Nothing changes a Statement once made.
@dataclass(slots=True)
class Statement:
    """One statement of an insert, as every driver's ``execute`` can take it: ``sql`` with
    ``:name`` parameters and a dict (SQLAlchemy's ``text()``, sqlite3; ``%(name)s`` for the
    pyformat drivers), or with ``%s`` parameters and a tuple (the MySQL drivers' own form)."""

    sql: str
    params: dict[str, Any] | tuple[Any, ...]
    simple: bool = False
    """Several statements in one text: only a client-binding cursor (a simple query) runs it."""
    repair: Statement | None = None
    """Run when this statement inserted no row, then this statement again: it inserts by
    joining a lock row that was missing, and ``repair`` puts the row back (``write/mysql.py``)."""

    @property
    def named(self) -> bool:
        """True for ``:name`` parameters and a dict."""
        return isinstance(self.params, dict)


@functools.lru_cache(maxsize=512)
def clause(sql: str) -> TextClause:
    """SQLAlchemy's ``text(sql)``, one per statement text: the texts are few (PostgreSQL's
    one, a MySQL chunk's per row count, SQLite's per row count), and compiling one costs more
    than a row. SQLAlchemy is imported at the first call: a script staging on a raw psycopg
    connection never needs it, and its import costs a third of a second at start."""
    from sqlalchemy import text

    return text(sql)
