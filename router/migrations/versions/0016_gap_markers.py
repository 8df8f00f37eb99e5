"""Gap markers: a stream whose head was abandoned says so in the next message it delivers.

When a row with a stream key is abandoned (refused for good by its broker, or out of
attempts), the rows after it on its stream and target are delivered anyway (the ``skip``
ordering, the router's behaviour so far), and until now nothing told their consumer that one
was missing. From this revision the mark that abandons such a row records it in
``router_gaps`` (target, stream key, seq, message id, when), in the same transaction; a claim
names, for each row it takes, the gaps before it on its stream and target, oldest first (the
row's ``skipped``), which the rendered message carries (the ``skipped`` field of the internal
envelope and the ``skipped-message-ids`` header); the mark that publishes the row deletes the
gaps it named. ``router requeue`` deletes the gap of a row it puts back, and ``router
cleanup`` the gaps older than the abandoned rows' retention.

The primary key ``(target, stream_key, seq)`` serves the claim's lookups (every gap of one
stream before a row) and its check that a target has any gap at all; ``ix_router_gaps_abandoned``
serves the cleanup. Message ids are ``uuid`` on PostgreSQL and their text on the others, as in
the outbox; on MySQL (see 0001) the key columns are ``VARCHAR`` of the outbox's lengths.

On PostgreSQL ``router_claim()`` returns a column more (``skipped``) and ``router_mark()`` takes
the target and the gaps its published rows named: new functions, so the old ones are dropped
first. The claim asks once whether the target has any gap before it looks up any row's, as
it asks once whether any stream is held back (0013): a target without gaps pays one probe of
an empty index per claim. MySQL/MariaDB and SQLite do the same in their stores' statements.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from router.migrations.history import earlier

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

# Literal copies of what this revision installs (migrations are history and load nothing
# of the project; the current text, with its reasons, is router/relay/store/postgres_sql.py).

CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION router_claim(p_target text, p_limit integer, p_worker text,
                                        p_hold_seconds double precision, p_async boolean,
                                        p_after bigint)
RETURNS TABLE (seq bigint, message_id text, destination text, envelope text,
               attempts integer, stream_key text, created_at double precision,
               skipped text[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_held_back boolean;
    v_gaps boolean;
BEGIN
    -- A lost batch only leaves its rows queued: no need to wait for the WAL flush.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    PERFORM set_config('application_name', p_worker, true);
    -- A worker that goes silent for p_hold_seconds loses its session, and so its rows.
    PERFORM set_config('idle_in_transaction_session_timeout',
                       (ceil(p_hold_seconds * 1000))::bigint::text, true);
    -- Busy while finished queue slots are being emptied (router_ring.gate_until).
    IF EXISTS (SELECT 1 FROM router_ring r WHERE r.id AND r.gate_until > clock_timestamp()) THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::integer,
                            NULL::text, NULL::double precision, NULL::text[];
        RETURN;
    END IF;
    -- Batches of one target take turns: busy (a NULL seq) while another is in flight.
    IF NOT pg_try_advisory_xact_lock(1869903203, hashtext(p_target)) THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::integer,
                            NULL::text, NULL::double precision, NULL::text[];
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM router_targets t WHERE t.target = p_target AND t.paused) THEN
        RETURN;
    END IF;
    v_held_back := EXISTS (
        SELECT 1 FROM router_outbox_queue p
        WHERE p.target = p_target AND p.status IN ('processing', 'failed')
          AND CASE WHEN p.status = 'processing' THEN p.locked_until ELSE p.available_at END
              > now());
    v_gaps := EXISTS (SELECT 1 FROM router_gaps g WHERE g.target = p_target);
    RETURN QUERY
    WITH picked AS (
        SELECT o.seq, o.message_id::text, o.destination, o.envelope::text, o.attempts + 1,
               o.stream_key, extract(epoch FROM o.created_at)::double precision
        FROM router_outbox_queue o
        WHERE o.target = p_target
          -- Start at the first queued row: whichever index the planner picks then skips the
          -- published history instead of walking it (statistics cannot tell it lies first).
          AND o.seq >= (SELECT min(f.seq) FROM router_outbox_queue f
                        WHERE f.target = p_target AND f.seq > p_after
                          AND f.status IN ('pending', 'failed'))
          AND o.seq > p_after
          AND o.status IN ('pending', 'failed') AND o.available_at <= now()
          AND (NOT v_held_back OR o.stream_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM router_outbox_queue p
                WHERE p.target = o.target AND p.stream_key = o.stream_key
                  AND (p.target, p.stream_key, p.seq) < (o.target, o.stream_key, o.seq)
                  AND p.status IN ('processing', 'failed')
                  AND CASE WHEN p.status = 'processing' THEN p.locked_until ELSE p.available_at END
                      > now()))
        ORDER BY o.target, o.seq
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    SELECT picked.*,
           CASE WHEN v_gaps AND picked.stream_key IS NOT NULL THEN ARRAY(
               SELECT g.message_id::text FROM router_gaps g
               WHERE g.target = p_target AND g.stream_key = picked.stream_key
                 AND g.seq < picked.seq
               ORDER BY g.seq) END
    FROM picked;
END
$$
"""

MARK_FUNCTION = """
CREATE OR REPLACE FUNCTION router_mark(p_published bigint[], p_receipts text[],
                                       p_failed bigint[], p_delays double precision[],
                                       p_failed_errors text[],
                                       p_abandoned bigint[], p_abandoned_errors text[],
                                       p_target text, p_reported_keys text[],
                                       p_reported_ids text[])
RETURNS void
LANGUAGE plpgsql
SET enable_nestloop = off
SET enable_seqscan = off
AS $$
DECLARE
    -- The time of the outcome; now() is the transaction's start, batches earlier.
    v_now timestamptz := clock_timestamp();
    v_slot bigint;
BEGIN
    FOR v_slot IN
        SELECT DISTINCT ((seq >> 15) & 7) FROM unnest(p_published || p_failed || p_abandoned) AS seq
    LOOP
        IF cardinality(p_published) > 0 THEN
            UPDATE router_outbox AS o
            SET status = 'published', published_at = v_now, last_error = NULL,
                receipt = t.receipt, attempts = o.attempts + 1, last_attempt_at = v_now,
                first_attempt_at = coalesce(o.first_attempt_at, v_now)
            FROM unnest(p_published, p_receipts) AS t(seq, receipt)
            WHERE NOT (o.status IN ('published', 'abandoned'))
              AND ((o.seq >> 15) & 7) = v_slot
              AND o.seq = ANY(p_published) AND o.seq = t.seq;
        END IF;
        IF cardinality(p_failed) > 0 THEN
            UPDATE router_outbox AS o
            SET status = 'failed', available_at = v_now + make_interval(secs => t.delay),
                last_error = t.error, attempts = o.attempts + 1, last_attempt_at = v_now,
                first_attempt_at = coalesce(o.first_attempt_at, v_now)
            FROM unnest(p_failed, p_delays, p_failed_errors) AS t(seq, delay, error)
            WHERE NOT (o.status IN ('published', 'abandoned'))
              AND ((o.seq >> 15) & 7) = v_slot
              AND o.seq = ANY(p_failed) AND o.seq = t.seq;
        END IF;
        IF cardinality(p_abandoned) > 0 THEN
            WITH abandoned AS (
                UPDATE router_outbox AS o
                SET status = 'abandoned', last_error = t.error, attempts = o.attempts + 1,
                    last_attempt_at = v_now,
                    first_attempt_at = coalesce(o.first_attempt_at, v_now)
                FROM unnest(p_abandoned, p_abandoned_errors) AS t(seq, error)
                WHERE NOT (o.status IN ('published', 'abandoned'))
              AND ((o.seq >> 15) & 7) = v_slot
                  AND o.seq = ANY(p_abandoned) AND o.seq = t.seq
                RETURNING o.target, o.stream_key, o.seq, o.message_id
            )
            INSERT INTO router_gaps (target, stream_key, seq, message_id, abandoned_at)
            SELECT a.target, a.stream_key, a.seq, a.message_id, v_now
            FROM abandoned a WHERE a.stream_key IS NOT NULL
            ON CONFLICT DO NOTHING;
        END IF;
    END LOOP;
    IF cardinality(p_reported_ids) > 0 THEN
        DELETE FROM router_gaps g
        WHERE g.target = p_target AND g.stream_key = ANY(p_reported_keys)
          AND g.message_id = ANY(p_reported_ids::uuid[]);
    END IF;
END
$$
"""

CLAIM_SIGNATURE = "router_claim(text, integer, text, double precision, boolean, bigint)"
MARK_SIGNATURE = (
    "router_mark(bigint[], text[], bigint[], double precision[], text[], bigint[], text[], "
    "text, text[], text[])"
)
PREVIOUS_MARK_SIGNATURE = (
    "router_mark(bigint[], text[], bigint[], double precision[], text[], bigint[], text[])"
)

GAPS_MYSQL = """
CREATE TABLE router_gaps (
    target VARCHAR(64) NOT NULL,
    stream_key VARCHAR(512) NOT NULL,
    seq BIGINT NOT NULL,
    message_id CHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    abandoned_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (target, stream_key, seq),
    KEY ix_router_gaps_abandoned (abandoned_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "mysql":
        op.execute(GAPS_MYSQL)
        return
    postgres = dialect == "postgresql"
    now = sa.text("now()") if postgres else sa.text("(strftime('%Y-%m-%d %H:%M:%f', 'now'))")
    op.create_table(
        "router_gaps",
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("stream_key", sa.Text(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column(
            "message_id",
            postgresql.UUID(as_uuid=True) if postgres else sa.String(36),
            nullable=False,
        ),
        sa.Column("abandoned_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.PrimaryKeyConstraint("target", "stream_key", "seq", name="pk_router_gaps"),
    )
    op.create_index("ix_router_gaps_abandoned", "router_gaps", ["abandoned_at"])
    if postgres:
        # Another result (the claim) and other arguments (the mark) make new functions: drop
        # the old ones, or calls would be ambiguous (and CREATE OR REPLACE refuses the first).
        op.execute(f"DROP FUNCTION {CLAIM_SIGNATURE}")
        op.execute(f"DROP FUNCTION {PREVIOUS_MARK_SIGNATURE}")
        op.execute(CLAIM_FUNCTION)
        op.execute(MARK_FUNCTION)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(f"DROP FUNCTION {CLAIM_SIGNATURE}")
        op.execute(f"DROP FUNCTION {MARK_SIGNATURE}")
        op.execute(earlier("0013_stream_check_only_when_held_back.py").CLAIM_FUNCTION)
        op.execute(earlier("0011_partitioned_outbox.py").MARK_FUNCTION)
    op.drop_table("router_gaps")
