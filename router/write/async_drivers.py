"""The connections ``Outbox.stage`` takes, each behind the shape ``router.write.drivers``
gives the sync ones: its dialect, ``execute`` for one ``Statement`` in the caller's
transaction, and ``scalar`` for the schema probe.

- SQLAlchemy's ``AsyncSession`` and ``AsyncConnection`` (asyncpg, aiosqlite, asyncmy,
  aiomysql): ``text()`` statements, or the driver's own ``%s`` form for MySQL's.
- A raw asyncpg connection: the same statements, their parameters numbered (``$1``...).

``async_driver`` refuses, before anything is written, a connection outside a transaction or
in AUTOCOMMIT, and sync connections, which ``SyncOutbox.stage`` takes. ``insert`` runs a
call's statements, putting back what a statement found missing (``Statement.repair``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from envelopes import StagingError
from router.write.drivers import sqlalchemy_unit
from router.write.postgres import numbered
from router.write.statements import Copy, Statement, clause
from router.write.units import Unit

__all__ = ["AsyncDriver", "AsyncpgDriver", "async_driver", "insert", "is_asyncpg"]


class AsyncDriver(Protocol):
    """One caller's async connection, as the async writer uses it."""

    dialect: str
    """``postgresql``, ``mysql`` or ``sqlite``: which statements it takes."""

    async def execute(self, statement: Statement) -> int:
        """Run one statement in the caller's transaction; the rows it wrote."""

    async def scalar(self, sql: str) -> object:
        """The first value of a read-only query without parameters, in the caller's
        transaction."""

    async def unit(self) -> Unit | None:
        """The caller's transaction as ``router.write.units`` tracks it (a SQLAlchemy
        connection's root transaction); None for asyncpg, whose transaction PostgreSQL
        knows."""


async def async_driver(connection: Any) -> AsyncDriver:
    """The driver for ``connection``; ``StagingError`` if it cannot stage in a transaction."""
    if is_asyncpg(connection):
        return AsyncpgDriver(connection)
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(connection, AsyncSession):
        return SqlAlchemyAsyncDriver(await connection.connection())
    if isinstance(connection, AsyncConnection):
        return SqlAlchemyAsyncDriver(connection)
    sync = type(connection).__module__.partition(".")[0] in {"sqlalchemy", "django"}
    raise StagingError(
        "stage() takes a SQLAlchemy AsyncSession or AsyncConnection, or an asyncpg "
        f"connection; got {type(connection).__name__}"
        + (" (a sync connection: stage on it with SyncOutbox.stage(...))" if sync else "")
    )


async def insert(driver: AsyncDriver, statements: Sequence[Statement | Copy]) -> None:
    """Run ``statements`` in order. One that wrote no row and has a ``repair`` (it inserts
    by joining a lock row that was missing) gets the row put back and runs again."""
    for statement in statements:
        assert isinstance(statement, Statement)  # no Copy: async drivers do not ask for one
        if await driver.execute(statement) == 0 and statement.repair is not None:
            await driver.execute(statement.repair)
            await driver.execute(statement)


def is_asyncpg(connection: Any) -> bool:
    """Whether ``connection`` is asyncpg's own (a connection, or a pool's proxy of one):
    once per class, not a string split per stage() call."""
    kind = type(connection)
    found = _ASYNCPG_CLASSES.get(kind)
    if found is None:
        found = _ASYNCPG_CLASSES[kind] = kind.__module__.partition(".")[0] == "asyncpg"
    return found


_ASYNCPG_CLASSES: dict[type, bool] = {}


@functools.lru_cache(maxsize=512)
def _numbered_arguments(
    sql: str,
) -> tuple[str, Callable[[Mapping[str, Any]], tuple[Any, ...]]]:
    """``numbered(sql)``, with a function that takes a statement's parameters, in their
    numbers' order, from its dict (an ``itemgetter``: no generator run per call)."""
    text, names = numbered(sql)
    if not names:
        return text, lambda _params: ()
    if len(names) == 1:
        one = names[0]
        return text, lambda params: (params[one],)
    return text, operator.itemgetter(*names)


class AsyncpgDriver:
    """A raw asyncpg connection, inside ``connection.transaction()``."""

    dialect = "postgresql"

    def __init__(self, connection: Any) -> None:
        if not connection.is_in_transaction():
            raise StagingError(
                "stage() needs the connection inside a transaction "
                "(async with connection.transaction(): ...)"
            )
        self.connection = connection

    async def execute(self, statement: Statement) -> int:
        """Run one statement, its parameters numbered; the rows it wrote."""
        assert isinstance(statement.params, dict)  # PostgreSQL's are named
        sql, arguments = _numbered_arguments(statement.sql)
        status = await self.connection.execute(sql, *arguments(statement.params))
        # The command tag: "INSERT 0 3", "SELECT 1".
        return int(status.rpartition(" ")[2] or -1)

    async def scalar(self, sql: str) -> object:
        """The first value of ``sql``'s first row."""
        return await self.connection.fetchval(sql)

    async def unit(self) -> None:
        """None: PostgreSQL knows the transaction (``router.write.units.unit_count``)."""


class SqlAlchemyAsyncDriver:
    """A SQLAlchemy ``AsyncConnection`` (an ``AsyncSession``'s, in its transaction)."""

    def __init__(self, connection: Any) -> None:
        # A transaction SQLAlchemy autobegan is a real one the caller commits; only
        # AUTOCOMMIT (on the engine or in execution options) makes its BEGIN a no-op.
        # SQLAlchemy keeps the engine-wide setting on the dialect with no public accessor, so
        # this asks the same private method SQLAlchemy itself consults before emitting BEGIN.
        sync = connection.sync_connection
        if sync is not None and sync._is_autocommit_isolation():
            raise StagingError(
                "stage() needs the connection inside a transaction, but it runs in "
                "AUTOCOMMIT (isolation_level='AUTOCOMMIT'), so each statement would "
                "commit on its own, apart from the caller's work; stage on a connection "
                "without AUTOCOMMIT, in a transaction (async with session.begin(): ... "
                "or async with engine.begin() as connection: ...)"
            )
        self.connection = connection
        self.dialect: str = connection.dialect.name

    async def execute(self, statement: Statement) -> int:
        """Run one statement; the rows it wrote."""
        if statement.named:
            result = await self.connection.execute(clause(statement.sql), statement.params)
        else:
            result = await self.connection.exec_driver_sql(statement.sql, statement.params)
        return int(result.rowcount)

    async def scalar(self, sql: str) -> object:
        """The first value of ``sql``'s first row."""
        return (await self.connection.exec_driver_sql(sql)).scalar()

    async def unit(self) -> Unit:
        """The unit of the connection's root transaction (``sqlalchemy_unit``), begun first
        if the connection has not begun it yet."""
        if not self.connection.in_transaction():
            await self.connection.begin()
        return sqlalchemy_unit(self.connection.sync_connection)
