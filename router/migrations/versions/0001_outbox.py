"""Create router_outbox.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

OPEN = "status IN ('pending', 'processing', 'failed')"


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    now = sa.text("now()") if postgres else sa.text("(strftime('%Y-%m-%d %H:%M:%f', 'now'))")
    columns = [
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            *([sa.Identity(always=False)] if postgres else []),
            primary_key=True,
        ),
        sa.Column(
            "message_id",
            postgresql.UUID(as_uuid=True) if postgres else sa.String(36),
            nullable=False,
        ),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("stream_key", sa.Text(), nullable=True),
        sa.Column("envelope", postgresql.JSON() if postgres else sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("available_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("locked_by", sa.Text(), nullable=True),
        sa.Column("locked_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
    ]
    op.create_table(
        "router_outbox",
        *columns,
        sa.CheckConstraint(
            "status IN ('pending', 'processing', 'published', 'failed', 'abandoned')",
            name="ck_router_outbox_status",
        ),
        sqlite_autoincrement=True,
    )
    if postgres:
        # The inserting transaction's id: a claim never passes a row whose transaction may
        # still be open, so rows are published in commit order (see router/relay/store/postgres.py).
        op.execute(
            "ALTER TABLE router_outbox ADD COLUMN xid xid8 NOT NULL DEFAULT pg_current_xact_id()"
        )
    op.create_index(
        "uq_router_outbox_message_target", "router_outbox", ["message_id", "target"], unique=True
    )
    # Claims read open rows of one target in order: this index stays small however many
    # published rows are kept for audit.
    for name, columns_ in (
        ("ix_router_outbox_claim", ["target", "seq"]),
        ("ix_router_outbox_due", ["target", "available_at"]),
    ):
        op.create_index(
            name,
            "router_outbox",
            columns_,
            postgresql_where=sa.text(OPEN),
            sqlite_where=sa.text(OPEN),
        )


def downgrade() -> None:
    op.drop_table("router_outbox")
