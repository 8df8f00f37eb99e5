"""The rows of one application transaction on MySQL/MariaDB and SQLite: ``atomic: true``.

0018 let a target publish each transaction's rows as one unit on PostgreSQL, which records
every row's transaction (``xid``, since 0001). The other databases now record it too: a
nullable ``xid`` (BIGINT) that ``stage()`` fills for the rows of atomic targets with a token
the client draws per application transaction (``router.write.units``), NULL for every other
row. The relay counts a unit's open rows by ``(target, xid)``:

- SQLite: ``ADD COLUMN`` (a nullable column without a default needs no copy of the table)
  and a partial index on ``(target, xid) WHERE xid IS NOT NULL``: rows of other targets pay
  nothing for it.
- MySQL/MariaDB: one ``ALTER`` (a nullable column last is instant on MariaDB 10.3+ and MySQL
  8.0.12+, the index is built online). Neither has partial indexes, so every row gets an
  entry; a row of a target without ``atomic`` carries NULL, and its entry lands at the end of
  its target's NULLs, as ``seq`` grows, where a random token's would land anywhere.

PostgreSQL: nothing (its xid column and 0018's index serve it).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "mysql":
        op.execute(
            "ALTER TABLE router_outbox ADD COLUMN xid BIGINT NULL,"
            " ADD KEY ix_router_outbox_unit (target, xid)"
        )
    elif dialect == "sqlite":
        op.add_column("router_outbox", sa.Column("xid", sa.BigInteger, nullable=True))
        op.create_index(
            "ix_router_outbox_unit",
            "router_outbox",
            ["target", "xid"],
            sqlite_where=sa.text("xid IS NOT NULL"),
        )


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "mysql":
        op.execute("ALTER TABLE router_outbox DROP KEY ix_router_outbox_unit, DROP COLUMN xid")
    elif dialect == "sqlite":
        op.drop_index("ix_router_outbox_unit", "router_outbox")
        op.drop_column("router_outbox", "xid")
