"""The connection helpers every operator query shares: an engine or a transaction per
configured database (driver errors turned into ``DatabaseError`` naming the database, never
its URL), the databases a command asked for, and times as the commands show and stamp them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from envelopes import ConfigError, DatabaseError
from router._db import create_engine
from router.config import RouterConfig
from router.ops.times import utc

__all__ = ["check_targets", "clock", "connect", "database_names", "engine", "iso", "now"]


@contextlib.asynccontextmanager
async def engine(config: RouterConfig, database: str) -> AsyncIterator[AsyncEngine]:
    """An engine on one configured database, disposed when the block ends."""
    made = create_engine(
        config.databases[database], config.base_dir, name=database, pool_pre_ping=False
    )
    try:
        yield made
    except sa.exc.DBAPIError as exc:
        cause = exc.orig or exc
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise DatabaseError(f"{database}: {type(cause).__name__}: {first}") from None
    except OSError as exc:
        raise DatabaseError(f"{database}: cannot connect: {exc.strerror or exc}") from None
    finally:
        await made.dispose()


@contextlib.asynccontextmanager
async def connect(config: RouterConfig, database: str) -> AsyncIterator[AsyncConnection]:
    """One transaction on a database (committed when the block ends without error)."""
    async with engine(config, database) as made, made.begin() as conn:
        yield conn


def now() -> datetime:
    """Now, in UTC."""
    return datetime.now(UTC)


def clock(conn: AsyncConnection) -> Any:
    """Now, for a stamp that wakes processors: the server's clock on MySQL.

    MySQL has no NOTIFY; its store's watcher wakes the processors when the newest pending
    ``available_at`` rises or the paused targets change (``router.relay.store.mysql_sql``'s
    ``WATCH``). The server stamps every other row, so a requeue stamped by a client clock
    behind the server's would raise nothing, and its rows would wait for the fallback poll.
    """
    return sa.func.utc_timestamp(6) if conn.dialect.name == "mysql" else now()


def iso(value: Any) -> str | None:
    """A time as the database returned it, as ISO 8601 in UTC to the millisecond."""
    moment = utc(value)
    return moment.isoformat(timespec="milliseconds") if moment else None


def database_names(config: RouterConfig, database: str | None) -> list[str]:
    """The one database asked for, or all of them. An unknown name is the operator's
    mistake, not the database's: a ``ConfigError`` naming the configured ones."""
    if database is None:
        return list(config.databases)
    if database not in config.databases:
        raise ConfigError(f"unknown database {database!r}; configured: {sorted(config.databases)}")
    return [database]


def check_targets(config: RouterConfig, database: str | None, names: Iterable[str]) -> None:
    """``ConfigError`` naming the configured targets unless each of ``names`` is a target of
    ``database`` (of any database when None): a filter on a misspelt target would match
    nothing, and an action on it would do nothing, silently."""
    known = sorted({t for db in database_names(config, database) for t in config.brokers_of(db)})
    for name in names:
        if name not in known:
            where = f" in database {database!r}" if database else ""
            raise ConfigError(f"unknown target {name!r}{where}; configured: {known}")
