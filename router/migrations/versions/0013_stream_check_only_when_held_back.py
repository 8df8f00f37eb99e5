"""PostgreSQL: a claim checks candidates' streams only while some stream is held back.

A claim passes over a row while an earlier row of its stream waits to retry. Until this
revision it looked for such a row for every candidate: one probe of the stream index in each
of the queue's eight slots per candidate, 8,000 of the 8,568 buffers a 500-row claim of a
healthy target read. Now the claim first asks once whether any row of the target is failed
and not yet due (or, as before 0010, leased); when none is, every candidate's check would
pass, and the per-candidate check is skipped. The answer holds for the claim: only the holder
of the target's lock, which the claim has taken by then, marks rows failed. Nothing else
changes; SQLite and MariaDB are untouched.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

from router.migrations.history import earlier

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# A literal copy of what this revision installs (migrations are history and load nothing
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
DECLARE
    v_held_back boolean;
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
                            NULL::text, NULL::double precision;
        RETURN;
    END IF;
    -- Batches of one target take turns: busy (a NULL seq) while another is in flight.
    IF NOT pg_try_advisory_xact_lock(1869903203, hashtext(p_target)) THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::integer,
                            NULL::text, NULL::double precision;
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
    SELECT * FROM picked;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(CLAIM_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(earlier("0012_stream_check_by_stream_index.py").CLAIM_FUNCTION)
