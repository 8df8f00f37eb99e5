"""Alembic environment for the router's own tables (``router init-db`` runs it).

The router keeps its revision in ``router_alembic_version`` so it never touches an
application's own Alembic history in the same database.
"""

from __future__ import annotations

from alembic import context

VERSION_TABLE = "router_alembic_version"

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=None,
    version_table=VERSION_TABLE,
    transaction_per_migration=True,
)
with context.begin_transaction():
    context.run_migrations()
