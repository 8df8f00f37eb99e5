"""Create router_outbox.

MySQL and MariaDB (issue #18) follow the same history as PostgreSQL and SQLite: each revision
that creates or changes a table does it on MySQL too (a branch of literal SQL), and 0005 to
0007, which only replace PostgreSQL functions and settings, do nothing there. So revision 0007
is head on every database, and ``SCHEMA_REVISION`` (router/relay/store/base.py) means the
same everywhere; a revision of its own for the MySQL schema would have made head a revision
that changes nothing on PostgreSQL or SQLite, which their running routers would then refuse
until ``router init-db``. No MySQL database was migrated before these branches existed, so
adding them rewrites no one's history. MySQL commits each DDL statement on its own: a failed
migration there leaves what it had done (``router init-db`` tells which statement failed).

On MySQL (``OUTBOX_MYSQL``):

- times are ``DATETIME(6)`` in UTC, written by the server (``UTC_TIMESTAMP(6)``), so no
  session time zone is involved; ``envelope`` is ``LONGTEXT``, which keeps the stored text
  byte for byte (MySQL's ``JSON`` type rewrites it), as PostgreSQL's ``json`` does;
- text is ``utf8mb4_bin``: broker names and stream keys compare as PostgreSQL compares them
  (the server's default collation would make ``Order-1`` and ``order-1`` one stream);
- the columns indexed are ``VARCHAR`` (64 for a broker name, whose config pattern allows 63;
  512 for a stream key, which ``stage()`` checks), as InnoDB indexes no whole ``TEXT``;
- MySQL has no partial index: ``ix_router_outbox_claim`` is ``(target, status, seq)``, so a
  claim reads each open status's rows in outbox order and never walks the published history,
  and ``ix_router_outbox_due`` is ``(target, status, available_at)`` for the next due time.

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

OUTBOX_MYSQL = """
CREATE TABLE router_outbox (
    seq BIGINT NOT NULL AUTO_INCREMENT,
    message_id CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    target VARCHAR(64) NOT NULL,
    destination TEXT NOT NULL,
    event_type TEXT NOT NULL,
    stream_key VARCHAR(512) NULL,
    envelope LONGTEXT NOT NULL,
    status VARCHAR(16) NOT NULL DEFAULT 'pending',
    attempts INT NOT NULL DEFAULT 0,
    available_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    locked_by TEXT NULL,
    locked_until DATETIME(6) NULL,
    last_error MEDIUMTEXT NULL,
    created_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    published_at DATETIME(6) NULL,
    PRIMARY KEY (seq),
    UNIQUE KEY uq_router_outbox_message_target (message_id, target),
    KEY ix_router_outbox_claim (target, status, seq),
    KEY ix_router_outbox_due (target, status, available_at),
    CONSTRAINT ck_router_outbox_status
        CHECK (status IN ('pending', 'processing', 'published', 'failed', 'abandoned'))
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "mysql":
        op.execute(OUTBOX_MYSQL)
        return
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
