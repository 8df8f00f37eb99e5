"""Per-stream order and fenced leases.

- ``lease_token``: each claim stamps its rows with a fresh random token; marks and releases
  apply only to rows still carrying it, so a worker that lost its lease (paused, partitioned,
  expired) cannot mark rows another claim now holds.
- ``ix_router_outbox_stream``: finds, for a row, an earlier row of the same stream on the same
  target that is in flight or waiting to retry (which holds it back). Only such rows are in
  it, so it stays tiny however long the backlog.
- ``router_claim()`` (PostgreSQL): the claim as one round trip. It first takes a per-target
  advisory lock, then claims in a statement of its own, so it sees every claim committed
  before it: a row can never be claimed while an earlier row of its stream is in flight
  under a claim that committed a moment ago.

On MySQL (see 0001): the same column and index (in full, as MySQL has no partial index; with
``status`` before ``seq``, so the claim's look for an earlier in-flight or failed row of a
stream reads only such rows), and ``router_streams``, one row per stream key. MySQL has no
transaction-scoped advisory lock (``GET_LOCK`` belongs to the session and outlives COMMIT and
ROLLBACK, and a pooled session would keep it), so ``stage()`` locks its stream keys' rows in
this table instead, which InnoDB releases exactly when the caller commits or rolls back (see
router/write/staging.py). The claim is the store's own SQL (router/relay/store/mysql_sql.py).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


CLAIM_FUNCTION = """
CREATE FUNCTION router_claim(p_target text, p_limit integer, p_worker text,
                             p_lease_seconds double precision, p_token bigint)
RETURNS TABLE (seq bigint, message_id text, destination text, envelope text,
               attempts integer, stream_key text)
LANGUAGE plpgsql AS $$
BEGIN
    -- Claims of one target take turns; the statement below then starts with a snapshot that
    -- includes every claim committed before this one.
    PERFORM pg_advisory_xact_lock(1869903203, hashtext(p_target));
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
        attempts = u.attempts + 1
    FROM picked
    WHERE u.seq = picked.seq
    RETURNING u.seq, u.message_id::text, u.destination, u.envelope::text, u.attempts,
              u.stream_key;
END
$$
"""


STREAM_INDEX_MYSQL = """
ALTER TABLE router_outbox
    ADD COLUMN lease_token BIGINT NULL,
    ADD KEY ix_router_outbox_stream (target, stream_key, status, seq)
"""

STREAMS_MYSQL = """
CREATE TABLE router_streams (
    stream_key VARCHAR(512) NOT NULL,
    PRIMARY KEY (stream_key)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "mysql":
        op.execute(STREAM_INDEX_MYSQL)
        op.execute(STREAMS_MYSQL)
        return
    postgres = op.get_bind().dialect.name == "postgresql"
    with op.batch_alter_table("router_outbox") as table:
        table.add_column(sa.Column("lease_token", sa.BigInteger(), nullable=True))
    where = sa.text("status IN ('processing', 'failed') AND stream_key IS NOT NULL")
    op.create_index(
        "ix_router_outbox_stream",
        "router_outbox",
        ["target", "stream_key", "seq"],
        postgresql_where=where,
        sqlite_where=where,
    )
    if postgres:
        op.execute(CLAIM_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "mysql":
        op.execute("DROP TABLE router_streams")
        op.execute(
            "ALTER TABLE router_outbox DROP KEY ix_router_outbox_stream, DROP COLUMN lease_token"
        )
        return
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION router_claim(text, integer, text, double precision, bigint)")
    op.drop_index("ix_router_outbox_stream", "router_outbox")
    with op.batch_alter_table("router_outbox") as table:
        table.drop_column("lease_token")
