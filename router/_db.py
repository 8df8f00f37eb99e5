"""Database URLs and engines: one place that knows how each URL form maps to each driver."""

from __future__ import annotations

import importlib
import importlib.util
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from envelopes import ConfigError
from router.config import DatabaseSettings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "MYSQL_DRIVER",
    "POSTGRES_DRIVER",
    "SQLITE_BUSY_TIMEOUT",
    "asyncpg_dsn",
    "create_engine",
    "missing_driver",
    "mysql_connect_args",
    "require_driver",
    "sqlalchemy_url",
    "sqlite_path",
    "sqlite_time",
]

# Seconds a SQLite writer waits for the lock; the app and the router share one file.
SQLITE_BUSY_TIMEOUT = 30.0

# The MySQL/MariaDB driver, for the application's engine and the router's store alike (the
# `mysql` extra; pyproject.toml says why this one). Imported only when such a database opens.
MYSQL_DRIVER = "asyncmy"
# PostgreSQL's, an extra too (`postgresql`): an application that only stages from sync code
# (SyncOutbox on psycopg, Django) needs no asyncio driver.
POSTGRES_DRIVER = "asyncpg"


def asyncpg_dsn(database: DatabaseSettings) -> str:
    """A DSN asyncpg accepts (``postgresql://...``). With several hosts, it connects only
    to the one that accepts writes unless the URL asks otherwise: after a failover the old
    primary may come back as a standby, where every claim would fail."""
    url = database.url.get_secret_value()
    scheme, _, rest = url.partition("://")
    dsn = f"postgresql://{rest}" if scheme.startswith("postgres") else url
    if len(database.hosts()) > 1 and "target_session_attrs=" not in dsn.partition("?")[2]:
        dsn += ("&" if "?" in dsn else "?") + "target_session_attrs=read-write"
    return dsn


def sqlite_path(database: DatabaseSettings, base_dir: Path) -> Path:
    """The SQLite file, relative paths anchored at the config's folder."""
    rest = database.url.get_secret_value().partition("://")[2]
    raw = rest[1:] if rest.startswith("/") else rest
    raw = raw.partition("?")[0]
    if raw in ("", ":memory:"):
        raise ValueError("an in-memory SQLite database cannot be shared with the router")
    path = Path(raw).expanduser()
    return path if path.is_absolute() else (base_dir / path).resolve()


def _driver_of(kind: str) -> tuple[str, str, str] | None:
    """The async driver a database kind needs from an extra: its module, the extra, and
    what the error calls the database. None for SQLite, whose driver comes with the package."""
    if kind == "mysql":
        return MYSQL_DRIVER, "mysql", "a MySQL or MariaDB database"
    if kind == "postgresql":
        return POSTGRES_DRIVER, "postgresql", "a PostgreSQL database"
    return None


def require_driver(kind: str, where: str) -> ModuleType | None:
    """The async driver module of a database kind; ``ConfigError`` naming ``where`` (the
    database's YAML path, ``databases.<name>``) and the extra to install when it is missing."""
    driver = _driver_of(kind)
    if driver is None:
        return None
    try:
        return importlib.import_module(driver[0])
    except ImportError as exc:
        raise ConfigError(missing_driver(kind, where, exc.name)) from None


def missing_driver(kind: str, where: str, module: str | None = None) -> str | None:
    """What to tell the user whose database of ``kind`` has no driver installed, when the
    driver is not installed (``module``: the import that failed); None if it is."""
    driver = _driver_of(kind)
    if driver is None:
        return None
    name, extra, what = driver
    if module is None and importlib.util.find_spec(name) is not None:
        return None
    return (
        f"{where}: {what} needs the {name} driver ({module or name} is not installed): "
        f"pip install 'outbox-router[{extra}]'"
    )


def mysql_connect_args(database: DatabaseSettings) -> dict[str, Any]:
    """The driver's connect arguments for a ``mysql://`` or ``mariadb://`` URL:
    ``user:password@host:port/database``, with ``?charset=`` and ``?unix_socket=``."""
    parts = urlsplit(database.url.get_secret_value())
    query = dict(parse_qsl(parts.query))
    args: dict[str, Any] = {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or 3306,
        "user": unquote(parts.username or "root"),
        "password": unquote(parts.password or ""),
        "database": unquote(parts.path.lstrip("/")) or None,
        # Envelopes are UTF-8 JSON; a server whose default is latin1 would mangle them.
        "charset": query.get("charset", "utf8mb4"),
    }
    if "unix_socket" in query:
        args["unix_socket"] = query["unix_socket"]
    return args


def sqlalchemy_url(database: DatabaseSettings, base_dir: Path) -> str:
    """The SQLAlchemy async URL for a database (asyncpg, asyncmy or aiosqlite driver)."""
    if database.kind == "sqlite":
        return f"sqlite+aiosqlite:///{sqlite_path(database, base_dir)}"
    if database.kind == "mysql":
        # mysql+ for MariaDB too: the dialect's name is then "mysql", the kind stage() expects.
        rest = database.url.get_secret_value().partition("://")[2]
        query = urlsplit(f"mysql://{rest}").query
        charset = "" if "charset=" in query else ("&" if query else "?") + "charset=utf8mb4"
        return f"mysql+{MYSQL_DRIVER}://{rest}{charset}"
    rest = asyncpg_dsn(database).partition("://")[2]
    hosts = database.hosts()
    if len(hosts) < 2:
        return f"postgresql+asyncpg://{rest}"
    # SQLAlchemy's URL has one host: several go in the query, as its asyncpg dialect takes
    # them (comma lists, which IPv6 addresses survive).
    netloc, _, tail = rest.partition("/")
    user = netloc.rpartition("@")[0]
    name, _, query = tail.partition("?")
    servers = "host={}&port={}".format(
        ",".join(host for host, _ in hosts), ",".join(str(port) for _, port in hosts)
    )
    user = f"{user}@" if user else ""
    return f"postgresql+asyncpg://{user}/{name}?{servers}{'&' if query else ''}{query}"


def create_engine(
    database: DatabaseSettings, base_dir: Path, *, name: str | None = None, **kwargs: Any
) -> AsyncEngine:
    """An async engine for application code that stages events in this database (``name``,
    its key under ``databases:``, names it in a missing driver's error)."""
    # Imported here: the relay (router serve) reaches its databases without SQLAlchemy, and
    # importing it would cost a worker a third of a second before its first claim.
    from sqlalchemy import event
    from sqlalchemy.ext.asyncio import create_async_engine

    require_driver(
        database.kind, f"databases.{name}" if name else f"database {database.public_url()}"
    )
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
