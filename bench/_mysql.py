"""MariaDB (or MySQL) next to PostgreSQL in a benchmark: ``--database``, a fresh database
per run on the shared server, and a raw asyncmy connection for hand-written baselines.

The server is the one the tests use, 127.0.0.1:3306 as root with no password (override with
``BENCH_MYSQL_ADMIN``, a ``mysql://`` URL without a database). Each run gets its own
database, made with ``CREATE DATABASE``, migrated by ``router init-db``'s own ``upgrade`` and
dropped at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncmy

from bench import _common
from router._db import mysql_connect_args
from router.config import DatabaseSettings
from router.ops.migrate import upgrade

__all__ = [
    "DATABASES",
    "MYSQL_ADMIN",
    "add_database_option",
    "chosen",
    "connect",
    "fresh_database",
    "fresh_mysql_database",
    "mysql_url",
    "server_name",
    "server_settings",
]

MYSQL_ADMIN = os.environ.get("BENCH_MYSQL_ADMIN", "mysql://root@127.0.0.1:3306")
DATABASES = ("postgresql", "mysql")

# What decides what a commit costs on the server: the redo log's flush at commit (1: each
# commit waits for it, as PostgreSQL's synchronous_commit=on does) and the binary log.
SETTINGS = {
    "version": "VERSION()",
    "innodb_flush_log_at_trx_commit": "@@innodb_flush_log_at_trx_commit",
    "log_bin": "@@log_bin",
    "sync_binlog": "@@sync_binlog",
    "innodb_buffer_pool_size": "@@innodb_buffer_pool_size",
}


def add_database_option(parser: argparse.ArgumentParser) -> None:
    """``--database postgresql|mysql|both`` (default postgresql)."""
    parser.add_argument(
        "--database",
        choices=[*DATABASES, "both"],
        default="postgresql",
        help="where the outbox lives; both: the two take turns in the same run",
    )


def chosen(option: str) -> tuple[str, ...]:
    """The databases a ``--database`` value names, PostgreSQL first."""
    return DATABASES if option == "both" else (option,)


def mysql_url(database: str) -> str:
    """The URL of a database on the benchmark's MariaDB server."""
    return MYSQL_ADMIN.rstrip("/") + "/" + database


async def connect(url: str | None = None, **options: Any) -> Any:
    """A raw asyncmy connection to ``url`` (None: the server, no database)."""
    args = mysql_connect_args(DatabaseSettings.model_validate({"url": url or MYSQL_ADMIN}))
    return await asyncmy.connect(**{**args, **options})


async def _admin(statement: str) -> None:
    conn = await connect(autocommit=True)
    try:
        async with conn.cursor() as cursor:
            await cursor.execute(statement)
    finally:
        await conn.ensure_closed()


@contextlib.contextmanager
def _quiet_driver() -> Iterator[None]:
    """asyncmy logs the server's notes as warnings, and the migration draws one that says
    nothing ("Name 'router_alembic_version_pkc' ignored for PRIMARY key"): not in the table."""
    driver = logging.getLogger("asyncmy")
    level = driver.level
    driver.setLevel(logging.ERROR)
    try:
        yield
    finally:
        driver.setLevel(level)


@contextlib.asynccontextmanager
async def fresh_mysql_database(label: str) -> AsyncIterator[str]:
    """A migrated, empty MariaDB database for one measurement; dropped afterwards."""
    name = f"bench_{label}_{uuid.uuid4().hex[:8]}"
    await _admin(f"CREATE DATABASE `{name}`")
    try:
        url = mysql_url(name)
        with _quiet_driver():
            await upgrade(name, DatabaseSettings.model_validate({"url": url}), Path.cwd())
        yield url
    finally:
        await _admin(f"DROP DATABASE IF EXISTS `{name}`")


def fresh_database(kind: str, label: str) -> contextlib.AbstractAsyncContextManager[str]:
    """A fresh, migrated database of ``kind`` ('postgresql' or 'mysql'); yields its URL."""
    if kind == "mysql":
        return fresh_mysql_database(label)
    return _common.fresh_database(label)


async def server_settings() -> dict[str, Any]:
    """The MariaDB server's version and the settings that decide a commit's cost."""
    conn = await connect()
    try:
        async with conn.cursor() as cursor:
            await cursor.execute("SELECT " + ", ".join(SETTINGS.values()))
            row = await cursor.fetchone()
    finally:
        await conn.ensure_closed()
    return dict(zip(SETTINGS, row, strict=True))


def server_name(version: str) -> str:
    """'MariaDB' or 'MySQL', from ``VERSION()``."""
    return "MariaDB" if "mariadb" in version.lower() else "MySQL"
