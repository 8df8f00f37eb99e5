"""Outbox stores: the processor's view of one database (PostgreSQL, MySQL/MariaDB or SQLite)."""

from __future__ import annotations

from pathlib import Path

from router._db import asyncpg_dsn, mysql_connect_args, require_driver, sqlite_path
from router.config import DatabaseSettings
from router.relay.store.base import (
    OPEN_STATUSES,
    SCHEMA_REVISION,
    BatchLost,
    Claim,
    ClaimedRow,
    Marks,
    OutboxStore,
    Wake,
    Wakeup,
    new_token,
)

__all__ = [
    "OPEN_STATUSES",
    "SCHEMA_REVISION",
    "BatchLost",
    "Claim",
    "ClaimedRow",
    "Marks",
    "OutboxStore",
    "Wake",
    "Wakeup",
    "new_token",
    "open_store",
]


def open_store(
    name: str,
    database: DatabaseSettings,
    base_dir: Path,
    *,
    vacuum_after: int = 50_000,
    durable: bool = False,
) -> OutboxStore:
    """The store for one configured database; connections open on first use."""
    if database.kind == "sqlite":
        from router.relay.store.sqlite import SqliteStore

        return SqliteStore(name, sqlite_path(database, base_dir))
    require_driver(database.kind, f"databases.{name}")  # missing: a ConfigError naming the extra
    if database.kind == "mysql":
        from router.relay.store.mysql import MysqlStore

        return MysqlStore(
            name,
            mysql_connect_args(database),
            pool_size=database.pool_size,
            wakeup=database.wakeup,
        )
    from router.relay.store.postgres import PostgresStore

    return PostgresStore(
        name,
        asyncpg_dsn(database),
        pool_size=database.pool_size,
        vacuum_after=vacuum_after,
        durable=durable,
        wakeup=database.wakeup,
    )
