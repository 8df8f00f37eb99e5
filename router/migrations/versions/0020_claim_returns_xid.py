"""The claim returns each row's transaction id: an atomic target's units, read with the rows.

An atomic target publishes the rows of one application transaction as one unit, so its claim
needs each claimed row's transaction (``xid``). Until this revision the relay looked it up by
seq in a second statement; the queue is partitioned by ``seq``'s ring slot, with no index on
``seq`` alone across it, and with the statistics of a fresh outbox the planner read every
queued row of the target through the unit index (0018) to find 500 of them: 10 ms a claim
on a backlog of 6,000, and more as the backlog grew. ``router_claim()`` now returns ``xid``
(as a bigint, before ``skipped``), read from the row it has in hand. A new result column is a
new function: the old one is dropped first. Nothing else changes.

MySQL/MariaDB and SQLite: nothing (their claims are statements the router sends, which read
``xid`` by the primary key).

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

from router.migrations.history import earlier

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

# The claim before this revision (0017's), whose signature the drop names.
PREVIOUS_SIGNATURE = "router_claim(text, integer, text, double precision, boolean, bigint)"

# A literal copy of what this revision installs (migrations are history and load nothing of
# the project; the current text, with its reasons, is router/relay/store/postgres_sql.py).
CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION router_claim(p_target text, p_limit integer, p_worker text,
                                        p_hold_seconds double precision, p_async boolean,
                                        p_after bigint)
RETURNS TABLE (seq bigint, message_id text, destination text, envelope text,
               attempts integer, stream_key text, created_at double precision,
               xid bigint, skipped text[])
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
                            NULL::text, NULL::double precision, NULL::bigint,
                            NULL::text[];
        RETURN;
    END IF;
    -- Batches of one target take turns: busy (a NULL seq) while another is in flight.
    IF NOT pg_try_advisory_xact_lock(1869903203, hashtext(p_target)) THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::integer,
                            NULL::text, NULL::double precision, NULL::bigint,
                            NULL::text[];
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM router_targets t WHERE t.target = p_target AND t.paused) THEN
        RETURN;
    END IF;
    v_held_back := EXISTS (
        SELECT 1 FROM router_outbox_queue p
        WHERE p.target = p_target AND p.status IN ('processing', 'failed', 'held', 'parked')
          AND CASE WHEN p.status = 'processing' THEN p.locked_until
                   WHEN p.status = 'failed' THEN p.available_at
                   ELSE 'infinity' END > now());
    IF v_held_back AND EXISTS (
        SELECT 1 FROM router_outbox_queue p WHERE p.target = p_target AND p.status = 'parked')
    THEN
        WITH first_queued AS (
            SELECT c.seq, c.stream_key FROM router_outbox_queue c
            WHERE c.target = p_target AND c.seq > p_after
              AND c.status IN ('pending', 'failed')
            ORDER BY c.target, c.seq
            LIMIT p_limit
        ), behind_parked AS (
            SELECT x.seq FROM router_outbox_queue x
            WHERE x.target = p_target AND x.status IN ('pending', 'failed')
              AND x.seq IN (
                SELECT w.seq FROM first_queued w
                WHERE w.stream_key IS NOT NULL AND EXISTS (
                    SELECT 1 FROM router_outbox_queue p
                    WHERE p.target = p_target AND p.stream_key = w.stream_key
                      AND (p.target, p.stream_key, p.seq) < (p_target, w.stream_key, w.seq)
                      AND p.status = 'parked'))
            FOR UPDATE SKIP LOCKED
        )
        UPDATE router_outbox_queue AS o SET status = 'parked'
        FROM behind_parked b
        WHERE o.target = p_target AND o.seq = b.seq AND o.status IN ('pending', 'failed');
    END IF;
    v_gaps := EXISTS (SELECT 1 FROM router_gaps g WHERE g.target = p_target);
    RETURN QUERY
    WITH picked AS (
        SELECT o.seq, o.message_id::text, o.destination, o.envelope::text, o.attempts + 1,
               o.stream_key, extract(epoch FROM o.created_at)::double precision,
               o.xid::text::bigint
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
                  AND p.status IN ('processing', 'failed', 'held', 'parked')
                  AND CASE WHEN p.status = 'processing' THEN p.locked_until
                           WHEN p.status = 'failed' THEN p.available_at
                           ELSE 'infinity' END > now()))
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


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"DROP FUNCTION {PREVIOUS_SIGNATURE}")
    op.execute(CLAIM_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"DROP FUNCTION {PREVIOUS_SIGNATURE}")
    op.execute(earlier("0017_held_and_parked.py").CLAIM_FUNCTION)
