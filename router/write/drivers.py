"""The connections ``SyncOutbox.stage`` takes, each behind one small shape: its dialect, and
``execute`` for one ``Statement`` in the caller's transaction.

- SQLAlchemy's sync ``Session`` and ``Connection`` (psycopg, psycopg2, PyMySQL, mysqlclient,
  pysqlite): the same ``text()`` statements the async path runs.
- Django's connection (``django.db.connection`` or ``connections[alias]``), inside
  ``transaction.atomic()``: its driver is ``router.contrib.django.driver``'s, with Django's
  integration, and shares the psycopg 3 path below.
- Raw DB-API connections of psycopg 3, psycopg2 and sqlite3.

Each also answers one read-only query (``scalar``), for the check before the first
INSERT (``router.write.checks.needs_schema_probe``), and names the application transaction
it stages in (``unit``), for targets with ``atomic: true`` (``router.write.units``): a
SQLAlchemy connection by its root transaction; a raw sqlite3 connection cannot tell one
transaction from the next, so each ``stage()`` call on it is a unit of its own.

``sync_driver`` refuses, before anything is written, a connection that would commit each
statement on its own (autocommit outside a transaction), and async connections, which
``Outbox.stage`` takes. Nothing here imports a driver: a connection is recognised by its
class's module, so an application has only the driver it uses installed.
"""

from __future__ import annotations

import functools
import importlib
import re
import sqlite3
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from envelopes import StagingError
from router.write.statements import Copy, Statement, clause
from router.write.units import Unit, transaction_unit

__all__ = [
    "AUTOCOMMIT",
    "SyncDriver",
    "dbapi_execute",
    "in_pipeline",
    "psycopg_execute",
    "pyformat",
    "sqlalchemy_unit",
    "sync_driver",
]


class SyncDriver(Protocol):
    """One caller's connection, as the sync writer uses it."""

    dialect: str
    """``postgresql``, ``mysql`` or ``sqlite``: which statements it takes."""

    copies: bool
    """Whether it runs a ``Copy`` too (psycopg 3), or only ``Statement``s."""

    simple: bool
    """Whether it prepares nothing and runs a ``simple`` statement (``Stager.statements``)."""

    def execute(self, statement: Statement | Copy) -> int:
        """Run one statement in the caller's transaction; the rows it wrote (-1 where the
        driver cannot tell)."""

    def scalar(self, sql: str) -> object:
        """The first value of a read-only query without parameters, in the caller's
        transaction."""

    def unit(self) -> Unit | None:
        """The caller's transaction as ``router.write.units`` tracks it; None where the
        driver cannot tell transactions apart and the database can (raw PostgreSQL)."""


AUTOCOMMIT = (
    "stage() needs the connection inside a transaction, but {what}, so each statement would "
    "commit on its own, apart from the caller's work; {fix}"
)


def sync_driver(connection: Any) -> SyncDriver:
    """The driver for ``connection``; ``StagingError`` if it cannot stage in a transaction."""
    make = _makers.get(type(connection))
    if make is None:
        make = _maker(type(connection))
        if len(_makers) < 64:  # an application has a few connection classes
            _makers[type(connection)] = make
    return make(connection)


_Maker = Callable[[Any], SyncDriver]
# The driver maker of each connection class met: which one a class needs is found once, not
# by a chain of imports and isinstance() checks on every stage() (in a loop of commits about
# 10 us of a call's 60-90 us of client time, cold caches and all).
_makers: dict[type, _Maker] = {}


def _maker(kind: type) -> _Maker:
    """How to make the driver of a ``kind`` connection (``StagingError`` when there is none)."""
    root = kind.__module__.partition(".")[0]
    # The DB-API connections first, without SQLAlchemy's import (a third of a second at a
    # script's start).
    if "Async" not in kind.__name__:
        if root == "psycopg":
            return PsycopgDriver
        if root == "psycopg2":
            return Psycopg2Driver
        if root == "django":
            return _django_driver()
        if issubclass(kind, sqlite3.Connection):
            return Sqlite3Driver
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session, scoped_session

    if issubclass(kind, scoped_session):  # Flask-SQLAlchemy's db.session
        return lambda registry: sync_driver(registry())
    if issubclass(kind, Session):  # an application's subclass too
        return lambda session: SqlAlchemyDriver(session.connection())
    if issubclass(kind, Connection):
        return SqlAlchemyDriver
    return functools.partial(_refuse, kind)


def _refuse(kind: type, connection: object) -> NoReturn:
    """Why ``stage()`` cannot take a connection of ``kind``."""
    root = kind.__module__.partition(".")[0]
    if root == "sqlalchemy":
        raise StagingError(
            f"SyncOutbox.stage() takes a SQLAlchemy Session or Connection; got "
            f"{kind.__name__}: stage on an AsyncSession or AsyncConnection with "
            "`await Outbox.stage(...)`"
        )
    raise StagingError(
        "SyncOutbox.stage() takes a SQLAlchemy Session or Connection, Django's connection, "
        f"or a psycopg, psycopg2 or sqlite3 connection; got {kind.__name__}"
        + (
            " (an async connection: stage on it with `await Outbox.stage(...)`)"
            if "Async" in kind.__name__ or root == "asyncpg"
            else ""
        )
    )


@functools.cache
def _django_driver() -> Callable[[Any], SyncDriver]:
    """``router.contrib.django``'s driver, imported by name when the first Django connection
    comes: write sits below contrib (the framework integrations build on it), and importing it
    up front would load that package for every application. The package imports no Django of
    its own; a Django connection means Django is loaded already."""
    module = importlib.import_module("router.contrib.django.driver")
    driver: Callable[[Any], SyncDriver] = module.DjangoDriver
    return driver


@functools.lru_cache(maxsize=512)
def pyformat(sql: str, kind: str = "s") -> str:
    """``:name`` parameters as ``%(name)s``, for drivers of the pyformat style (``kind`` "b":
    psycopg 3's ``%(name)b``, sent in binary). Cached: the texts are few, and converting one
    cost a stage() on psycopg about 5% of its time."""
    return _NAMED.sub(rf"%(\1){kind}", sql.replace("%", "%%"))


def dbapi_execute(connection: Any, statement: Statement | Copy) -> int:
    """Run one statement on a DB-API cursor of ``connection`` that takes ``%(name)s``
    (psycopg2's, Django's); the rows it wrote."""
    assert isinstance(statement, Statement)
    sql = pyformat(statement.sql) if statement.named else statement.sql
    with connection.cursor() as cursor:
        cursor.execute(sql, statement.params)
        return int(cursor.rowcount)


# A ``:name`` parameter, not a PostgreSQL ``::type`` cast or a ``:`` inside a word.
_NAMED = re.compile(r"(?<![:\w]):(\w+)")


class SqlAlchemyDriver:
    """A SQLAlchemy sync ``Connection`` (a ``Session``'s, in its transaction)."""

    copies = False
    simple = False

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.dialect: str = connection.dialect.name
        if connection._is_autocommit_isolation():  # what SQLAlchemy asks before BEGIN
            raise StagingError(
                AUTOCOMMIT.format(
                    what="it runs in AUTOCOMMIT (isolation_level='AUTOCOMMIT')",
                    fix="stage on a connection without AUTOCOMMIT, in a transaction "
                    "(with session.begin(): ... or with engine.begin() as connection: ...)",
                )
            )

    def execute(self, statement: Statement | Copy) -> int:
        """Run one statement on the connection; the rows it wrote."""
        assert isinstance(statement, Statement)
        if statement.named:
            result = self.connection.execute(clause(statement.sql), statement.params)
        else:
            result = self.connection.exec_driver_sql(statement.sql, statement.params)
        return int(result.rowcount)

    def scalar(self, sql: str) -> object:
        """The first value of ``sql``'s first row."""
        return self.connection.exec_driver_sql(sql).scalar()

    def unit(self) -> Unit:
        """The unit of the connection's root transaction."""
        return sqlalchemy_unit(self.connection)


def sqlalchemy_unit(connection: Any) -> Unit:
    """The unit of a SQLAlchemy sync ``Connection``'s root transaction (savepoints are part
    of it), begun here if the connection has not begun it yet (as its first statement
    would: a connection in AUTOCOMMIT was refused before)."""
    return transaction_unit(connection.get_transaction() or connection.begin())


def psycopg_execute(connection: Any, statement: Statement | Copy) -> int:
    """Run ``statement`` on a server-binding cursor of a psycopg 3 connection, whatever
    cursor class the connection makes by default, its arrays sent in binary (psycopg's text
    arrays cost the server a parse of every element). A statement is prepared on its first
    run (``prepare=True``): the few statements stage() sends repeat on every connection
    (unless the connection has preparing off, as Django's has by default). A ``simple`` one
    goes on a client-binding cursor, which sends it as a simple query. The rows it wrote."""
    if isinstance(statement, Statement) and statement.simple:
        with _cursor_class(client=True)(connection) as cursor:
            cursor.execute(pyformat(statement.sql), statement.params)
            return int(cursor.rowcount)
    with _cursor_class()(connection) as cursor:
        if isinstance(statement, Copy):
            with cursor.copy(statement.sql) as copy:
                copy.set_types(statement.types)
                for row in statement.rows:
                    copy.write_row(row)
            return int(cursor.rowcount)
        sql = pyformat(statement.sql, "b") if statement.named else statement.sql
        cursor.execute(sql, statement.params, prepare=True)
        return int(cursor.rowcount)


@functools.cache
def _cursor_class(*, client: bool = False) -> Any:
    """psycopg's ``Cursor`` (``ClientCursor``), imported on first use (an application may
    not have psycopg)."""
    import psycopg

    return psycopg.ClientCursor if client else psycopg.Cursor


class PsycopgDriver:
    """A psycopg 3 connection: in a transaction unless autocommit and idle."""

    dialect = "postgresql"

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        piped = in_pipeline(connection)
        self.copies = not piped
        self.simple = connection.prepare_threshold is None and not piped
        if connection.autocommit and _idle(connection):
            raise StagingError(
                AUTOCOMMIT.format(
                    what="the psycopg connection is in autocommit mode",
                    fix="stage inside `with connection.transaction():`, or on a connection "
                    "without autocommit (then commit it)",
                )
            )

    def execute(self, statement: Statement | Copy) -> int:
        """Run one statement on a cursor of the connection (``psycopg_execute``)."""
        return psycopg_execute(self.connection, statement)

    def scalar(self, sql: str) -> object:
        """The first value of ``sql``'s first row, as a tuple whatever the connection's
        ``row_factory``."""
        from psycopg.rows import tuple_row

        with _cursor_class()(self.connection, row_factory=tuple_row) as cursor:
            return cursor.execute(sql).fetchone()[0]

    def unit(self) -> None:
        """None: PostgreSQL knows the transaction (``router.write.units.unit_count``)."""


def in_pipeline(connection: Any) -> bool:
    """Whether a psycopg 3 connection is in pipeline mode (``with connection.pipeline():``).

    There every statement goes by the extended protocol, which takes neither COPY ("COPY
    cannot be used in pipeline mode") nor two statements in one query (the ``simple`` form):
    stage() sends its prepared forms instead, the unnest INSERT for many rows. Asked of the
    libpq connection (``pgconn.pipeline_status``, public, where ``connection._pipeline`` is
    not): an attribute read, no round trip."""
    return bool(connection.pgconn.pipeline_status)


def _idle(connection: Any) -> bool:
    """Whether a psycopg 3 connection is outside any transaction."""
    from psycopg.pq import TransactionStatus

    return bool(connection.info.transaction_status == TransactionStatus.IDLE)


class Psycopg2Driver:
    """A psycopg2 connection: in a transaction unless autocommit and idle."""

    dialect = "postgresql"
    copies = False
    simple = True  # it binds on the client and never prepares

    def __init__(self, connection: Any) -> None:
        from psycopg2.extensions import TRANSACTION_STATUS_IDLE

        self.connection = connection
        idle = connection.get_transaction_status() == TRANSACTION_STATUS_IDLE
        if connection.autocommit and idle:
            raise StagingError(
                AUTOCOMMIT.format(
                    what="the psycopg2 connection is in autocommit mode",
                    fix="stage on a connection without autocommit (then commit it)",
                )
            )

    def execute(self, statement: Statement | Copy) -> int:
        """Run one statement on a cursor of the connection; the rows it wrote."""
        return dbapi_execute(self.connection, statement)

    def scalar(self, sql: str) -> object:
        """The first value of ``sql``'s first row, as a tuple whatever the connection's
        ``cursor_factory`` (``RealDictCursor``, say)."""
        from psycopg2.extensions import cursor as plain

        with self.connection.cursor(cursor_factory=plain) as cursor:
            cursor.execute(sql)
            return cursor.fetchone()[0]

    def unit(self) -> None:
        """None: PostgreSQL knows the transaction (``router.write.units.unit_count``)."""


class Sqlite3Driver:
    """A sqlite3 connection: it opens a transaction before an INSERT unless it autocommits."""

    dialect = "sqlite"
    copies = False
    simple = False

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection
        # Python 3.12's autocommit attribute; before it (and by default after), the legacy
        # mode: isolation_level None means no implicit BEGIN.
        autocommit = getattr(connection, "autocommit", -1)
        legacy_autocommit = autocommit == -1 and connection.isolation_level is None
        if (autocommit is True or legacy_autocommit) and not connection.in_transaction:
            raise StagingError(
                AUTOCOMMIT.format(
                    what="the sqlite3 connection autocommits (isolation_level=None)",
                    fix="stage after connection.execute('BEGIN'), or on a connection with "
                    "the default isolation_level (then commit it)",
                )
            )

    def execute(self, statement: Statement | Copy) -> int:
        """Run one statement on the connection; the rows it wrote."""
        assert isinstance(statement, Statement)
        return self.connection.execute(statement.sql, statement.params).rowcount

    def scalar(self, sql: str) -> object:
        """The first value of ``sql``'s first row."""
        row: tuple[object, ...] = self.connection.execute(sql).fetchone()
        return row[0]

    def unit(self) -> Unit:
        """A unit of its own for each ``stage()`` call: a sqlite3 connection shows no
        transaction this one could be told apart from the next by (``in_transaction`` is
        a flag; its commit and rollback leave no trace)."""
        return Unit()
