"""The consumer side's inbox: one row per (consumer, message id) applied.

A consumer records an event's message id in its own transaction, next to the writes the
event causes; the primary key makes a second delivery (or a concurrent one) find it there
and skip. ``ix_router_inbox_received`` lets cleanup remove old records in bounded batches.

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


def upgrade() -> None:
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
