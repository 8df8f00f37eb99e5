"""Alembic environment for the router's own tables (``router init-db`` runs it).

The router keeps its revision in ``router_alembic_version`` so it never touches an
application's own Alembic history in the same database.
"""

from __future__ import annotations

import logging

from alembic import context

VERSION_TABLE = "router_alembic_version"


class _UnnamedPrimaryKey(logging.Filter):
    """MySQL names every primary key PRIMARY and warns that the name Alembic gives the version
    table's key is ignored; asyncmy logs that warning on each init-db. Nothing is wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_pkc' ignored for PRIMARY key" not in record.getMessage()


# env.py runs once per init-db: one filter, however many times.
_asyncmy = logging.getLogger("asyncmy")
if not any(type(f).__name__ == _UnnamedPrimaryKey.__name__ for f in _asyncmy.filters):
    _asyncmy.addFilter(_UnnamedPrimaryKey())

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=None,
    version_table=VERSION_TABLE,
    transaction_per_migration=True,
)
with context.begin_transaction():
    context.run_migrations()
