"""The router's tables in a Django database: the system check that they are at the newest
revision, and ``init_db()``, which brings them there.

The tables belong to the router's own Alembic history (``router/migrations``: per-dialect
SQL, its revision in ``router_alembic_version``), the one ``router init-db`` and
``router serve`` use. Django does not get a migration of its own for them: a Django
migration that ran it would record, in ``django_migrations``, a state that the next router
release moves past without Django knowing, and two tools would own one schema. So
``router init-db`` creates and upgrades them (deploy: ``router init-db``, then
``manage.py migrate``), and ``init_db(using)`` is the same upgrade for the database behind a
Django alias. Databases ``config.yaml`` does not name (Django's test databases) get them after
``migrate``: ``router.contrib.django.tables``.

The check reads the version with Django's own connection and compares it with the head of the
shipped migrations, found without a database. It looks only at Django databases that are
router databases (``matching_database``): a test database, whose name differs, is left alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envelopes import ConfigError
from router.contrib.django.config import get_outbox
from router.contrib.django.databases import matching_database

if TYPE_CHECKING:
    from collections.abc import Iterable

    from router.config import RouterConfig

__all__ = ["check_schema", "schema_revision"]

NOT_AT_HEAD = "router.E001"
CONFIG_UNREADABLE = "router.E002"
UNREACHABLE = "router.E003"


def schema_revision(connection: Any) -> str | None:
    """The router schema revision of the database behind Django's ``connection`` (``None``:
    the router's tables were never created there)."""
    from router.ops.migrate import VERSION_TABLE

    with connection.cursor() as cursor:
        if VERSION_TABLE not in connection.introspection.table_names(cursor):
            return None
        cursor.execute(f"SELECT version_num FROM {VERSION_TABLE}")
        row = cursor.fetchone()
    return str(row[0]) if row else None


def check_schema(
    app_configs: Iterable[Any] | None = None,
    databases: Iterable[str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Django system check (tag ``database``: ``manage.py check --database default``): an
    Error ``router.E001`` for each given database whose router tables are not at head,
    ``router.E003`` for one it cannot read, ``router.E002`` when the config cannot be read."""
    from django.core.checks import Error

    if not databases:
        return []
    try:
        config = get_outbox().config
    except ConfigError as exc:  # its message names the file and what is wrong
        return [Error(f"the router's config cannot be read: {exc}", id=CONFIG_UNREADABLE)]
    found = []
    for alias in databases:
        problem = _schema_problem(config, alias)
        if problem is not None:
            found.append(problem)
    return found


def _schema_problem(config: RouterConfig, alias: str) -> Any:
    """The Error for Django's database ``alias``, or None (at head, or not a router database)."""
    from django.core.checks import Error
    from django.db import DatabaseError, connections

    from router.ops.migrate import head_revision

    connection = connections[alias]
    name = matching_database(config, connection)
    if name is None:
        return None
    try:
        revision = schema_revision(connection)
    except DatabaseError as exc:
        return Error(
            f"cannot read the router schema of database {alias!r}: {type(exc).__name__}: {exc}",
            id=UNREACHABLE,
        )
    head = head_revision()
    if revision == head:
        return None
    where = f"Django database {alias!r} (router database {name!r})"
    return Error(
        f"{where} has no router tables"
        if revision is None
        else f"{where} is at router schema {revision}; this router needs {head}",
        hint="run `router init-db` (or router.contrib.django.init_db("
        f"{alias!r})) before `manage.py migrate`",
        id=NOT_AT_HEAD,
    )
