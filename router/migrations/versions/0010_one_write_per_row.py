"""PostgreSQL: one write per delivered row. The claim locks its rows instead of writing them.

Until 0009 a claim wrote every row it took ('processing', its worker, a lease token and the
lease's end) and the mark wrote it again: two new versions of each row, each with its index
entries. From this revision the router runs ``router_claim()`` in a transaction of its own and
keeps it open while it publishes the batch: the rows' locks are the lease, and
``router_mark()`` writes each row once, in the same transaction, before the commit. If the
worker dies its connection closes and the rows are queued as they were; one that goes silent
loses its session after ``outbox.lease_seconds`` idle (``idle_in_transaction_session_timeout``,
set for the transaction alone). While it holds a batch, the session's ``application_name`` is
the worker's id. The per-target advisory lock is held to the commit, so batches of one target
take turns and streams stay in order; a claim that finds it taken answers "busy" at once. A
worker draining a backlog claims the next batch in the same transaction while the current one
is published (the rows after it), and commits with the last batch's mark.

Both functions take new arguments, so 0009's are dropped. Rows a running 0009 router holds
('processing') are queued again, their attempt not counted, as a released lease would be; such
a router's marks are then fenced out by their token and its rows are delivered again (at least
once). SQLite and MariaDB keep their leases: nothing changes there.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

from router.migrations.history import earlier

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Literal copies of what this revision installs (migrations are history and load nothing
# of the project; the current text, with its reasons, is router/relay/store/postgres_sql.py).

CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION router_claim(p_target text, p_limit integer, p_worker text,
                                        p_hold_seconds double precision, p_async boolean,
                                        p_after bigint)
RETURNS TABLE (seq bigint, message_id text, destination text, envelope text,
               attempts integer, stream_key text, created_at double precision)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    -- A lost batch only leaves its rows queued: no need to wait for the WAL flush.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    PERFORM set_config('application_name', p_worker, true);
    -- A worker that goes silent for p_hold_seconds loses its session, and so its rows.
    PERFORM set_config('idle_in_transaction_session_timeout',
                       (ceil(p_hold_seconds * 1000))::bigint::text, true);
    -- Batches of one target take turns: busy (a NULL seq) while another is in flight.
    IF NOT pg_try_advisory_xact_lock(1869903203, hashtext(p_target)) THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::integer,
                            NULL::text, NULL::double precision;
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM router_targets t WHERE t.target = p_target AND t.paused) THEN
        RETURN;
    END IF;
    RETURN QUERY
    WITH picked AS (
        SELECT o.seq, o.message_id::text, o.destination, o.envelope::text, o.attempts + 1,
               o.stream_key, extract(epoch FROM o.created_at)::double precision
        FROM router_outbox o
        WHERE o.target = p_target
          -- Start at the first queued row: whichever index the planner picks then skips the
          -- published history instead of walking it (statistics cannot tell it lies first).
          AND o.seq >= (SELECT min(f.seq) FROM router_outbox f
                        WHERE f.target = p_target AND f.status IN ('pending', 'failed'))
          AND o.seq > p_after
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
    SELECT * FROM picked;
END
$$
"""

MARK_FUNCTION = """
CREATE OR REPLACE FUNCTION router_mark(p_published bigint[], p_receipts text[],
                                       p_failed bigint[], p_delays double precision[],
                                       p_failed_errors text[],
                                       p_abandoned bigint[], p_abandoned_errors text[])
RETURNS void
LANGUAGE plpgsql
SET enable_nestloop = off
SET enable_seqscan = off
AS $$
DECLARE
    -- The time of the outcome; now() is the transaction's start, batches earlier.
    v_now timestamptz := clock_timestamp();
BEGIN
    IF cardinality(p_published) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'published', published_at = v_now, last_error = NULL,
            receipt = t.receipt, attempts = o.attempts + 1, last_attempt_at = v_now,
            first_attempt_at = coalesce(o.first_attempt_at, v_now)
        FROM unnest(p_published, p_receipts) AS t(seq, receipt)
        WHERE o.seq = ANY(p_published) AND o.seq = t.seq;
    END IF;
    IF cardinality(p_failed) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'failed', available_at = v_now + make_interval(secs => t.delay),
            last_error = t.error, attempts = o.attempts + 1, last_attempt_at = v_now,
            first_attempt_at = coalesce(o.first_attempt_at, v_now)
        FROM unnest(p_failed, p_delays, p_failed_errors) AS t(seq, delay, error)
        WHERE o.seq = t.seq;
    END IF;
    IF cardinality(p_abandoned) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'abandoned', last_error = t.error, attempts = o.attempts + 1,
            last_attempt_at = v_now, first_attempt_at = coalesce(o.first_attempt_at, v_now)
        FROM unnest(p_abandoned, p_abandoned_errors) AS t(seq, error)
        WHERE o.seq = t.seq;
    END IF;
END
$$
"""

CLAIM_SIGNATURE = "router_claim(text, integer, text, double precision, boolean, bigint)"
MARK_SIGNATURE = (
    "router_mark(bigint[], text[], bigint[], double precision[], text[], bigint[], text[])"
)
PREVIOUS_CLAIM_SIGNATURE = "router_claim(text, integer, text, double precision, bigint, boolean)"
PREVIOUS_MARK_SIGNATURE = (
    "router_mark(bigint, bigint[], text[], bigint[], double precision[], text[], bigint[], "
    "text[], bigint[], boolean)"
)

# What 0009's leases become: queued again, the attempt not counted (as a release puts them).
REQUEUE_LEASED = """
UPDATE router_outbox
SET status = CASE WHEN attempts > 1 THEN 'failed' ELSE 'pending' END,
    attempts = attempts - 1, available_at = now(), locked_by = NULL, locked_until = NULL,
    lease_token = NULL
WHERE status = 'processing'
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"DROP FUNCTION {PREVIOUS_CLAIM_SIGNATURE}")
    op.execute(f"DROP FUNCTION {PREVIOUS_MARK_SIGNATURE}")
    op.execute(REQUEUE_LEASED)
    op.execute(CLAIM_FUNCTION)
    op.execute(MARK_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    previous = earlier("0009_receipts_and_audit.py")
    op.execute(f"DROP FUNCTION {CLAIM_SIGNATURE}")
    op.execute(f"DROP FUNCTION {MARK_SIGNATURE}")
    op.execute(previous.MARK_FUNCTION)
    op.execute(previous.CLAIM_FUNCTION)
