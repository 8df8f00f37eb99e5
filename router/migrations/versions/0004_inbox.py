"""The consumer side's inbox: one row per (consumer, message id) applied.

A consumer records an event's message id in its own transaction, next to the writes the
event causes; the primary key makes a second delivery (or a concurrent one) find it there
and skip. ``ix_router_inbox_received`` lets cleanup remove old records in bounded batches.

On MySQL (see 0001) the key columns are ``VARCHAR(255)``, as InnoDB indexes no whole ``TEXT``.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


INBOX_MYSQL = """
CREATE TABLE router_inbox (
    consumer VARCHAR(255) NOT NULL,
    message_id VARCHAR(255) NOT NULL,
    received_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer, message_id),
    KEY ix_router_inbox_received (received_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "mysql":
        op.execute(INBOX_MYSQL)
        return
    postgres = op.get_bind().dialect.name == "postgresql"
    now = sa.text("now()") if postgres else sa.text("(strftime('%Y-%m-%d %H:%M:%f', 'now'))")
    op.create_table(
        "router_inbox",
        sa.Column("consumer", sa.Text(), nullable=False),
        sa.Column("message_id", sa.Text(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.PrimaryKeyConstraint("consumer", "message_id", name="pk_router_inbox"),
    )
    op.create_index("ix_router_inbox_received", "router_inbox", ["received_at"])


def downgrade() -> None:
    op.drop_table("router_inbox")
