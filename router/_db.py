"""Database URLs and engines: one place that knows how each URL form maps to each driver."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from router.config import DatabaseSettings

__all__ = [
    "SQLITE_BUSY_TIMEOUT",
    "asyncpg_dsn",
    "create_engine",
    "sqlalchemy_url",
    "sqlite_path",
    "sqlite_time",
]

# Seconds a SQLite writer waits for the lock; the app and the router share one file.
SQLITE_BUSY_TIMEOUT = 30.0


def asyncpg_dsn(database: DatabaseSettings) -> str:
    """A DSN asyncpg accepts (``postgresql://...``)."""
    url = database.url.get_secret_value()
    scheme, _, rest = url.partition("://")
    return f"postgresql://{rest}" if scheme.startswith("postgres") else url


def sqlite_path(database: DatabaseSettings, base_dir: Path) -> Path:
    """The SQLite file, relative paths anchored at the config's folder."""
    rest = database.url.get_secret_value().partition("://")[2]
    raw = rest[1:] if rest.startswith("/") else rest
    raw = raw.partition("?")[0]
    if raw in ("", ":memory:"):
        raise ValueError("an in-memory SQLite database cannot be shared with the router")
    path = Path(raw).expanduser()
    return path if path.is_absolute() else (base_dir / path).resolve()


def sqlalchemy_url(database: DatabaseSettings, base_dir: Path) -> str:
    """The SQLAlchemy async URL for a database (asyncpg or aiosqlite driver)."""
    if database.kind == "sqlite":
        return f"sqlite+aiosqlite:///{sqlite_path(database, base_dir)}"
    return "postgresql+asyncpg://" + asyncpg_dsn(database).partition("://")[2]


def create_engine(database: DatabaseSettings, base_dir: Path, **kwargs: Any) -> AsyncEngine:
    """An async engine for application code that stages events in this database."""
    if database.kind == "sqlite":
        sqlite_path(database, base_dir).parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {"timeout": SQLITE_BUSY_TIMEOUT})
        engine = create_async_engine(sqlalchemy_url(database, base_dir), **kwargs)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(sqlalchemy_url(database, base_dir), **kwargs)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets the router read and claim while the application writes.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def sqlite_time(moment: datetime) -> str:
    """How SQLite columns hold times: UTC text that sorts like the time it names."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
