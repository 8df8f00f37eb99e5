"""Operations: paused targets, circuit state, attempt times, retention indexes.

- ``router_targets``: one row per target that was paused or whose circuit changed; a paused
  target is not claimed by any worker (the claim checks it), and status shows each circuit.
- ``last_attempt_at``: when a row was last tried (retry rate, abandoned-row retention).
- ``ix_router_outbox_published`` / ``ix_router_outbox_abandoned``: cleanup deletes old rows
  in bounded batches through these, without scanning the table.

On MySQL (see 0001) the same table and column; the cleanup indexes lead with ``status`` in
place of PostgreSQL's ``WHERE status = ...``. The claim locks the target's row here, so the
claims of one target take turns (router/relay/store/mysql_sql.py).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION router_claim(p_target text, p_limit integer, p_worker text,
                                        p_lease_seconds double precision, p_token bigint)
RETURNS TABLE (seq bigint, message_id text, destination text, envelope text,
               attempts integer, stream_key text, created_at double precision)
LANGUAGE plpgsql AS $$
BEGIN
    -- Claims of one target take turns; the statement below then starts with a snapshot that
    -- includes every claim committed before this one.
    PERFORM pg_advisory_xact_lock(1869903203, hashtext(p_target));
    IF EXISTS (SELECT 1 FROM router_targets t WHERE t.target = p_target AND t.paused) THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH picked AS (
        SELECT o.seq FROM router_outbox o
        WHERE o.target = p_target
          AND o.status IN ('pending', 'processing', 'failed')
          AND CASE WHEN o.status = 'processing' THEN o.locked_until ELSE o.available_at END
              <= now()
          AND (o.stream_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM router_outbox p
                WHERE p.target = o.target AND p.stream_key = o.stream_key AND p.seq < o.seq
                  AND p.status IN ('processing', 'failed')
                  AND CASE WHEN p.status = 'processing' THEN p.locked_until ELSE p.available_at END
                      > now()))
        ORDER BY o.seq
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE router_outbox AS u
    SET status = 'processing', locked_by = p_worker, lease_token = p_token,
        locked_until = now() + make_interval(secs => p_lease_seconds),
        attempts = u.attempts + 1, last_attempt_at = now()
    FROM picked
    WHERE u.seq = picked.seq
    RETURNING u.seq, u.message_id::text, u.destination, u.envelope::text, u.attempts,
              u.stream_key, extract(epoch FROM u.created_at)::double precision;
END
$$
"""


TARGETS_MYSQL = """
CREATE TABLE router_targets (
    target VARCHAR(64) NOT NULL,
    paused BOOLEAN NOT NULL DEFAULT FALSE,
    paused_at DATETIME(6) NULL,
    paused_by TEXT NULL,
    circuit VARCHAR(16) NOT NULL DEFAULT 'closed',
    circuit_since DATETIME(6) NULL,
    circuit_worker TEXT NULL,
    circuit_error TEXT NULL,
    PRIMARY KEY (target)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
"""

RETENTION_MYSQL = """
ALTER TABLE router_outbox
    ADD COLUMN last_attempt_at DATETIME(6) NULL,
    ADD KEY ix_router_outbox_published (status, published_at),
    ADD KEY ix_router_outbox_abandoned (status, last_attempt_at)
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "mysql":
        op.execute(TARGETS_MYSQL)
        op.execute(RETENTION_MYSQL)
        return
    postgres = op.get_bind().dialect.name == "postgresql"
    op.create_table(
        "router_targets",
        sa.Column("target", sa.Text(), primary_key=True),
        sa.Column("paused", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("paused_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("paused_by", sa.Text(), nullable=True),
        sa.Column("circuit", sa.Text(), nullable=False, server_default="closed"),
        sa.Column("circuit_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("circuit_worker", sa.Text(), nullable=True),
        sa.Column("circuit_error", sa.Text(), nullable=True),
    )
    with op.batch_alter_table("router_outbox") as table:
        table.add_column(sa.Column("last_attempt_at", sa.DateTime(timezone=True), nullable=True))
    published = sa.text("status = 'published'")
    abandoned = sa.text("status = 'abandoned'")
    op.create_index(
        "ix_router_outbox_published",
        "router_outbox",
        ["published_at"],
        postgresql_where=published,
        sqlite_where=published,
    )
    op.create_index(
        "ix_router_outbox_abandoned",
        "router_outbox",
        ["last_attempt_at"],
        postgresql_where=abandoned,
        sqlite_where=abandoned,
    )
    if postgres:
        op.execute("DROP FUNCTION router_claim(text, integer, text, double precision, bigint)")
        op.execute(CLAIM_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "mysql":
        op.execute(
            "ALTER TABLE router_outbox DROP KEY ix_router_outbox_abandoned, "
            "DROP KEY ix_router_outbox_published, DROP COLUMN last_attempt_at"
        )
        op.execute("DROP TABLE router_targets")
        return
    op.drop_index("ix_router_outbox_abandoned", "router_outbox")
    op.drop_index("ix_router_outbox_published", "router_outbox")
    with op.batch_alter_table("router_outbox") as table:
        table.drop_column("last_attempt_at")
    op.drop_table("router_targets")
