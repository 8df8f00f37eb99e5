"""Broker receipts, the first attempt's time, and an audit trail of operator actions.

- ``router_outbox.receipt``: where the broker put a published row's message, as the broker
  told the router when it acknowledged it (a JSON object: JetStream stream and sequence,
  Kafka topic, partition and offset, Redis stream and entry id, RabbitMQ confirm time).
  ``router trace`` shows it per target. NULL where the broker gives none (Service Bus).
- ``router_outbox.first_attempt_at``: when the row was first claimed; ``last_attempt_at``
  (0003) is the latest.
- ``router_audit``: one row per operator action (requeue, discard, replay, pause, resume, from
  the command line or over HTTP): who, when, what, on which target, how many rows.

On PostgreSQL ``router_mark()`` takes the published rows' receipts beside their seqs (a new
argument, so a new function: 0006's is dropped), pairing them by hash (it plans no nested
loop: without statistics one looped over the array for every row, 50 ms a mark), and
``router_claim()`` stamps the first attempt. Adding two NULL columns rewrites no row.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# Literal copies of what this revision installs (migrations are history and load nothing
# of the project; the current text, with its reasons, is router/relay/store/postgres_sql.py).

CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION router_claim(p_target text, p_limit integer, p_worker text,
                                        p_lease_seconds double precision, p_token bigint,
                                        p_async boolean)
RETURNS TABLE (seq bigint, message_id text, destination text, envelope text,
               attempts integer, stream_key text, created_at double precision)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    -- A lost claim only leaves its rows pending: no need to wait for the WAL flush.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    -- Claims of one target take turns; the statements below then start with a snapshot that
    -- includes every claim committed before this one.
    PERFORM pg_advisory_xact_lock(1869903203, hashtext(p_target));
    IF EXISTS (SELECT 1 FROM router_targets t WHERE t.target = p_target AND t.paused) THEN
        RETURN;
    END IF;
    UPDATE router_outbox
    SET status = 'failed', available_at = now(),
        last_error = 'lease ended before the attempt was marked (' || locked_by || ')',
        locked_by = NULL, locked_until = NULL
    WHERE target = p_target AND status = 'processing' AND locked_until <= now();
    RETURN QUERY
    WITH picked AS (
        SELECT o.seq FROM router_outbox o
        WHERE o.target = p_target
          -- Start at the first queued row: whichever index the planner picks then skips the
          -- published history instead of walking it (statistics cannot tell it lies first).
          AND o.seq >= (SELECT min(f.seq) FROM router_outbox f
                        WHERE f.target = p_target AND f.status IN ('pending', 'failed'))
          AND o.status IN ('pending', 'failed') AND o.available_at <= now()
          AND (o.stream_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM router_outbox p
                WHERE p.target = o.target AND p.stream_key = o.stream_key AND p.seq < o.seq
                  AND p.status IN ('processing', 'failed')
                  AND CASE WHEN p.status = 'processing' THEN p.locked_until ELSE p.available_at END
                      > now()))
        ORDER BY o.target, o.seq
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE router_outbox AS u
    SET status = 'processing', locked_by = p_worker, lease_token = p_token,
        locked_until = now() + make_interval(secs => p_lease_seconds),
        attempts = u.attempts + 1, last_attempt_at = now(),
        first_attempt_at = coalesce(u.first_attempt_at, now())
    WHERE u.seq = ANY (ARRAY(SELECT picked.seq FROM picked))
    RETURNING u.seq, u.message_id::text, u.destination, u.envelope::text, u.attempts,
              u.stream_key, extract(epoch FROM u.created_at)::double precision;
END
$$
"""

MARK_FUNCTION = """
CREATE OR REPLACE FUNCTION router_mark(p_token bigint,
                                       p_published bigint[], p_receipts text[],
                                       p_failed bigint[], p_delays double precision[],
                                       p_failed_errors text[],
                                       p_abandoned bigint[], p_abandoned_errors text[],
                                       p_untried bigint[], p_async boolean)
RETURNS void
LANGUAGE plpgsql
SET enable_nestloop = off
AS $$
BEGIN
    -- A lost mark only means its rows are delivered again once their lease ends.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    IF cardinality(p_published) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'published', published_at = now(), last_error = NULL,
            locked_by = NULL, locked_until = NULL, receipt = t.receipt
        FROM unnest(p_published, p_receipts) AS t(seq, receipt)
        WHERE o.seq = ANY(p_published) AND o.seq = t.seq
          AND o.lease_token = p_token AND o.status = 'processing';
    END IF;
    IF cardinality(p_failed) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'failed', available_at = now() + make_interval(secs => t.delay),
            last_error = t.error, locked_by = NULL, locked_until = NULL
        FROM unnest(p_failed, p_delays, p_failed_errors) AS t(seq, delay, error)
        WHERE o.seq = t.seq AND o.lease_token = p_token AND o.status = 'processing';
    END IF;
    IF cardinality(p_abandoned) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'abandoned', last_error = t.error, locked_by = NULL, locked_until = NULL
        FROM unnest(p_abandoned, p_abandoned_errors) AS t(seq, error)
        WHERE o.seq = t.seq AND o.lease_token = p_token AND o.status = 'processing';
    END IF;
    IF cardinality(p_untried) > 0 THEN
        -- Claimed but not sent: back in the queue, and the attempt does not count.
        UPDATE router_outbox
        SET status = CASE WHEN attempts > 1 THEN 'failed' ELSE 'pending' END,
            attempts = attempts - 1, available_at = now(), locked_by = NULL,
            locked_until = NULL
        WHERE seq = ANY(p_untried) AND lease_token = p_token AND status = 'processing';
    END IF;
END
$$
"""

PREVIOUS_CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION router_claim(p_target text, p_limit integer, p_worker text,
                                        p_lease_seconds double precision, p_token bigint,
                                        p_async boolean)
RETURNS TABLE (seq bigint, message_id text, destination text, envelope text,
               attempts integer, stream_key text, created_at double precision)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    -- A lost claim only leaves its rows pending: no need to wait for the WAL flush.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    -- Claims of one target take turns; the statements below then start with a snapshot that
    -- includes every claim committed before this one.
    PERFORM pg_advisory_xact_lock(1869903203, hashtext(p_target));
    IF EXISTS (SELECT 1 FROM router_targets t WHERE t.target = p_target AND t.paused) THEN
        RETURN;
    END IF;
    UPDATE router_outbox
    SET status = 'failed', available_at = now(),
        last_error = 'lease ended before the attempt was marked (' || locked_by || ')',
        locked_by = NULL, locked_until = NULL
    WHERE target = p_target AND status = 'processing' AND locked_until <= now();
    RETURN QUERY
    WITH picked AS (
        SELECT o.seq FROM router_outbox o
        WHERE o.target = p_target
          -- Start at the first queued row: whichever index the planner picks then skips the
          -- published history instead of walking it (statistics cannot tell it lies first).
          AND o.seq >= (SELECT min(f.seq) FROM router_outbox f
                        WHERE f.target = p_target AND f.status IN ('pending', 'failed'))
          AND o.status IN ('pending', 'failed') AND o.available_at <= now()
          AND (o.stream_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM router_outbox p
                WHERE p.target = o.target AND p.stream_key = o.stream_key AND p.seq < o.seq
                  AND p.status IN ('processing', 'failed')
                  AND CASE WHEN p.status = 'processing' THEN p.locked_until ELSE p.available_at END
                      > now()))
        ORDER BY o.target, o.seq
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE router_outbox AS u
    SET status = 'processing', locked_by = p_worker, lease_token = p_token,
        locked_until = now() + make_interval(secs => p_lease_seconds),
        attempts = u.attempts + 1, last_attempt_at = now()
    WHERE u.seq = ANY (ARRAY(SELECT picked.seq FROM picked))
    RETURNING u.seq, u.message_id::text, u.destination, u.envelope::text, u.attempts,
              u.stream_key, extract(epoch FROM u.created_at)::double precision;
END
$$
"""

PREVIOUS_MARK_FUNCTION = """
CREATE OR REPLACE FUNCTION router_mark(p_token bigint,
                                       p_published bigint[],
                                       p_failed bigint[], p_delays double precision[],
                                       p_failed_errors text[],
                                       p_abandoned bigint[], p_abandoned_errors text[],
                                       p_untried bigint[], p_async boolean)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    -- A lost mark only means its rows are delivered again once their lease ends.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    IF cardinality(p_published) > 0 THEN
        UPDATE router_outbox
        SET status = 'published', published_at = now(), last_error = NULL,
            locked_by = NULL, locked_until = NULL
        WHERE seq = ANY(p_published) AND lease_token = p_token AND status = 'processing';
    END IF;
    IF cardinality(p_failed) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'failed', available_at = now() + make_interval(secs => t.delay),
            last_error = t.error, locked_by = NULL, locked_until = NULL
        FROM unnest(p_failed, p_delays, p_failed_errors) AS t(seq, delay, error)
        WHERE o.seq = t.seq AND o.lease_token = p_token AND o.status = 'processing';
    END IF;
    IF cardinality(p_abandoned) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'abandoned', last_error = t.error, locked_by = NULL, locked_until = NULL
        FROM unnest(p_abandoned, p_abandoned_errors) AS t(seq, error)
        WHERE o.seq = t.seq AND o.lease_token = p_token AND o.status = 'processing';
    END IF;
    IF cardinality(p_untried) > 0 THEN
        -- Claimed but not sent: back in the queue, and the attempt does not count.
        UPDATE router_outbox
        SET status = CASE WHEN attempts > 1 THEN 'failed' ELSE 'pending' END,
            attempts = attempts - 1, available_at = now(), locked_by = NULL,
            locked_until = NULL
        WHERE seq = ANY(p_untried) AND lease_token = p_token AND status = 'processing';
    END IF;
END
$$
"""

PREVIOUS_MARK_SIGNATURE = (
    "router_mark(bigint, bigint[], bigint[], double precision[], text[], bigint[], text[], "
    "bigint[], boolean)"
)
MARK_SIGNATURE = (
    "router_mark(bigint, bigint[], text[], bigint[], double precision[], text[], bigint[], "
    "text[], bigint[], boolean)"
)

OUTBOX_MYSQL = """
ALTER TABLE router_outbox
    ADD COLUMN receipt TEXT NULL,
    ADD COLUMN first_attempt_at DATETIME(6) NULL
"""

AUDIT_MYSQL = """
CREATE TABLE router_audit (
    id BIGINT NOT NULL AUTO_INCREMENT,
    at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    actor TEXT NOT NULL,
    action VARCHAR(32) NOT NULL,
    target VARCHAR(64) NULL,
    detail TEXT NULL,
    row_count INT NOT NULL DEFAULT 0,
    PRIMARY KEY (id),
    KEY ix_router_audit_at (at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "mysql":
        op.execute(OUTBOX_MYSQL)
        op.execute(AUDIT_MYSQL)
        return
    postgres = dialect == "postgresql"
    with op.batch_alter_table("router_outbox") as table:
        table.add_column(sa.Column("receipt", sa.Text(), nullable=True))
        table.add_column(sa.Column("first_attempt_at", sa.DateTime(timezone=True), nullable=True))
    now = sa.text("now()") if postgres else sa.text("(strftime('%Y-%m-%d %H:%M:%f', 'now'))")
    op.create_table(
        "router_audit",
        # BIGSERIAL on PostgreSQL; SQLite numbers an INTEGER PRIMARY KEY (its rowid) itself.
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("target", sa.Text(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("row_count", sa.Integer(), nullable=False, server_default="0"),
    )
    op.create_index("ix_router_audit_at", "router_audit", ["at"])
    if postgres:
        # A new argument makes a new function: drop 0006's, or calls would be ambiguous.
        op.execute(f"DROP FUNCTION {PREVIOUS_MARK_SIGNATURE}")
        op.execute(MARK_FUNCTION)
        op.execute(CLAIM_FUNCTION)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "mysql":
        op.execute("DROP TABLE router_audit")
        op.execute("ALTER TABLE router_outbox DROP COLUMN receipt, DROP COLUMN first_attempt_at")
        return
    if dialect == "postgresql":
        op.execute(f"DROP FUNCTION {MARK_SIGNATURE}")
        op.execute(PREVIOUS_MARK_FUNCTION)
        op.execute(PREVIOUS_CLAIM_FUNCTION)
    op.drop_table("router_audit")
    with op.batch_alter_table("router_outbox") as table:
        table.drop_column("first_attempt_at")
        table.drop_column("receipt")
