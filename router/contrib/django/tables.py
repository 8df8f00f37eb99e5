"""The router's tables in Django databases that ``config.yaml`` does not name, above all
Django's test databases: brought to the newest revision after each ``migrate``.

``manage.py test`` (and pytest-django) creates ``test_<NAME>``, or an in-memory SQLite
database, and runs ``migrate`` on it; ``router init-db`` cannot reach it, as no config names
it, so ``stage()`` there would be refused. After ``migrate`` (Django's ``post_migrate``
signal) the app runs the router's own migrations on that database when:

- ``config.yaml`` does not name it: the databases it names are ``router init-db``'s, and the
  system check holds ``migrate`` until they are at head, so a deploy keeps one owner and one
  order for them;
- the project's database routers allow the app there (``allow_migrate(db, "outbox_router")``),
  as for any Django app's tables;
- they are not at the newest revision already (then nothing runs).

They run through Django's own driver on a new connection with the alias's settings, so they
reach whatever Django reaches, an in-memory SQLite test database included. Nothing is written
into ``django_migrations``: the revision stays in ``router_alembic_version``, where
``router init-db`` and ``router serve`` read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envelopes import ConfigError, DatabaseError
from router.contrib.django.config import get_outbox
from router.contrib.django.databases import matching_database

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from router.ops.migrate import MigrationResult

__all__ = ["APP_LABEL", "init_db", "migrate_tables", "upgrade_tables"]

APP_LABEL = "outbox_router"

# SQLAlchemy's dialect for each DB-API module Django's backends load. PyMySQL installed as
# MySQLdb (pymysql.install_as_MySQLdb()) is the pymysql module under that name.
_DIALECTS = {
    "psycopg": "postgresql+psycopg",
    "psycopg2": "postgresql+psycopg2",
    "MySQLdb": "mysql+mysqldb",
    "pymysql": "mysql+pymysql",
    "sqlite3": "sqlite+pysqlite",
}


def upgrade_tables(connection: Any) -> MigrationResult:
    """Bring the router's tables in the database of Django's ``connection`` to the newest
    revision (``router init-db`` for it), on a new connection of Django's own driver."""
    from sqlalchemy.exc import SQLAlchemyError

    from router.ops.migrate import upgrade_connection

    engine = _engine(connection)
    try:
        with engine.begin() as conn:
            return upgrade_connection(conn)
    except SQLAlchemyError as exc:
        cause = getattr(exc, "orig", None) or exc
        raise DatabaseError(
            f"Django database {connection.alias!r}: cannot create the router's tables: "
            f"{type(cause).__name__}: {str(cause).strip().splitlines()[0]}"
        ) from None
    finally:
        engine.dispose()


def migrate_tables(sender: Any, using: str, verbosity: int = 1, **kwargs: Any) -> None:
    """``post_migrate`` receiver: the router's tables in database ``using`` when config.yaml
    does not name it (see the module's docstring)."""
    from django.db import connections, router

    connection = connections[using]
    if not router.allow_migrate(using, APP_LABEL) or _named_by_config(connection):
        return
    from router.contrib.django.schema import schema_revision
    from router.ops.migrate import head_revision

    if schema_revision(connection) == head_revision():
        return
    result = upgrade_tables(connection)
    if verbosity >= 2:
        print(f"  Router tables of {using!r}: {result.before or 'empty'} -> {result.after}")


def _named_by_config(connection: Any) -> bool:
    try:
        config = get_outbox().config
    except ConfigError:
        # Nothing names it then; the check (router.E002) reports the config itself.
        return False
    return matching_database(config, connection) is not None


def _engine(connection: Any) -> Engine:
    """A SQLAlchemy engine whose one connection is a new one of Django's driver, made from the
    alias's settings (as Django makes its own, without its pool if it has one)."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    module = str(connection.Database.__name__).partition(".")[0]  # sqlite3.dbapi2
    dialect = _DIALECTS.get(module)
    if dialect is None:
        raise ConfigError(
            f"Django database {connection.alias!r} uses the driver {module}; the router's "
            f"tables can be created through {', '.join(sorted(_DIALECTS))}"
        )
    params = connection.get_connection_params()  # without Django's "pool" option
    return create_engine(
        f"{dialect}://",
        creator=lambda: connection.Database.connect(**params),
        poolclass=NullPool,
    )


def init_db(using: str = "default") -> MigrationResult:
    """``router init-db`` for the database behind Django's alias ``using``: the router's own
    migrations, to the newest revision; running it again changes nothing. It runs on a new
    connection of Django's own driver, so it reaches what Django reaches (an in-memory SQLite
    test database too)."""
    from django.db import connections

    return upgrade_tables(connections[using])
