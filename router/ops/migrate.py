"""``router init-db``: create or upgrade the router's tables with the migrations it ships."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from envelopes import DatabaseError
from router._db import create_engine, sqlite_path
from router.config import DatabaseSettings
from router.relay.store.base import VERSION_TABLE

__all__ = [
    "MIGRATIONS",
    "VERSION_TABLE",
    "MigrationResult",
    "current_revision",
    "head_revision",
    "migrate_to",
    "upgrade",
    "upgrade_connection",
]

MIGRATIONS = str(Path(__file__).parents[1] / "migrations")


@dataclass(frozen=True, slots=True)
class MigrationResult:
    """Revisions of one database before and after ``upgrade``."""

    before: str | None
    after: str | None

    @property
    def changed(self) -> bool:
        """True when a migration ran."""
        return self.before != self.after


def head_revision() -> str | None:
    """The newest revision shipped with this version of the router."""
    return ScriptDirectory.from_config(_alembic_config()).get_current_head()


async def upgrade(name: str, database: DatabaseSettings, base_dir: Path) -> MigrationResult:
    """Bring one database to the newest revision; running it again changes nothing."""
    return await migrate_to(name, database, base_dir, "head")


async def migrate_to(
    name: str, database: DatabaseSettings, base_dir: Path, revision: str
) -> MigrationResult:
    """Bring one database to ``revision``, up or down (down: for benchmarks and tests of a
    migration; the router itself only upgrades)."""
    if database.kind == "sqlite":
        sqlite_path(database, base_dir).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(database, base_dir, name=name, pool_pre_ping=False)
    try:
        async with engine.begin() as conn:
            return await conn.run_sync(_migrate, revision)
    except SQLAlchemyError as exc:
        raise DatabaseError(f"{name}: cannot migrate: {_describe(exc)}") from None
    except OSError as exc:
        raise DatabaseError(f"{name}: cannot connect: {exc.strerror or exc}") from None
    finally:
        await engine.dispose()


def upgrade_connection(connection: Connection) -> MigrationResult:
    """Bring the database behind a sync SQLAlchemy ``connection`` to the newest revision, in
    the connection's open transaction (for callers that bring their own driver: Django's)."""
    return _migrate(connection, "head")


def _migrate(connection: Connection, revision: str) -> MigrationResult:
    before = _current(connection)
    config = _alembic_config()
    config.attributes["connection"] = connection
    script = ScriptDirectory.from_config(config)
    target = script.get_current_head() if revision == "head" else revision
    if before is not None and target is not None and _is_ancestor(script, target, before):
        command.downgrade(config, target)
    else:
        command.upgrade(config, revision)
    return MigrationResult(before, _current(connection))


def _is_ancestor(script: ScriptDirectory, revision: str, of: str) -> bool:
    """True when ``revision`` comes strictly before ``of`` in the history."""
    return revision != of and any(r.revision == revision for r in script.walk_revisions("base", of))


def _current(connection: Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def _alembic_config() -> AlembicConfig:
    config = AlembicConfig()
    config.set_main_option("script_location", MIGRATIONS)
    return config


def _describe(exc: SQLAlchemyError) -> str:
    """The driver's own error (type and first line), without SQLAlchemy's wrapping."""
    cause: BaseException = getattr(exc, "orig", None) or exc
    text = str(cause).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__


async def current_revision(name: str, database: DatabaseSettings, base_dir: Path) -> str | None:
    """The revision a database is at (``None``: the router's tables were never created)."""
    if database.kind == "sqlite" and not sqlite_path(database, base_dir).exists():
        raise DatabaseError(f"{name}: {sqlite_path(database, base_dir)} does not exist")
    engine = create_engine(database, base_dir, name=name, pool_pre_ping=False)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(_current)
    except SQLAlchemyError as exc:
        raise DatabaseError(f"{name}: {_describe(exc)}") from None
    except OSError as exc:
        raise DatabaseError(f"{name}: cannot connect: {exc.strerror or exc}") from None
    finally:
        await engine.dispose()
