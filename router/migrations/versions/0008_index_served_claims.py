"""The claim is index-served whatever the statistics say; a claim writes two index entries
fewer per row.

What went wrong before: on an outbox without statistics (a fresh table, autovacuum off or not
yet run) and once PL/pgSQL had settled on a generic plan (after five calls), the planner could
check a candidate's stream against ``ix_router_outbox_due`` or ``ix_router_outbox_claim``
instead of ``ix_router_outbox_stream``, reading every entry of the target, dead ones included,
for every candidate row. A claim then cost time in proportion to every row the target had
delivered since the last VACUUM: 0.9 s for 500 rows on a 5,000-row backlog, and under a steady
trickle of one event per transaction, claims that grew slower every second until the router
fell behind for good. Which plan a session got depended on the table's state at its sixth
claim, so some runs collapsed and others did not.

- ``ix_router_outbox_claim`` (target, seq) now holds only queued rows (pending, failed): a
  claim moves a row out of it instead of adding a second entry.
- ``ix_router_outbox_stream`` (target, stream_key, seq) holds the rows in flight or waiting
  to retry, with or without a stream key; the stream-order check, lease ends, the heartbeat
  and a dead worker's release read it, and no other index can answer the stream check.
- ``ix_router_outbox_due`` (target, available_at) holds only failed rows (when the next
  retry is due); pending rows no longer get an entry.
- No statistics are kept for ``target`` and ``status``. Statistics taken during a backlog say
  nearly every row is pending, and they stay that way until the next ANALYZE, which with
  autovacuum off never comes: the planner then found the first queued row by walking the
  primary key from the oldest published row. Without them it assumes what is true once the
  outbox runs: queued rows are few, and their index is the way to them. (Changing a column's
  type to itself is what drops statistics already taken; it rewrites nothing.)
- ``router_claim()`` gives a row whose lease ran out back to the queue as a failed attempt
  before it claims (it used to claim such rows as they were), and runs with sequential and
  bitmap scans off, so min(seq) and the scan are read from the claim index in order.

Per delivered row that is 3 index entries written by the claim instead of 5, and 3 by the
insert instead of 4. The indexes are rebuilt in this migration (a plain CREATE INDEX: it
holds a write lock on router_outbox while it reads the table, which on a large outbox is
worth a maintenance window).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# Literal copies of what this revision installs (migrations are history and load nothing
# of the project; the current text, with its reasons, is router/relay/store/postgres_sql.py).

INDEXES = (
    "CREATE INDEX ix_router_outbox_claim ON router_outbox (target, seq)"
    " WHERE status IN ('pending', 'failed')",
    "CREATE INDEX ix_router_outbox_stream ON router_outbox (target, stream_key, seq)"
    " WHERE status IN ('processing', 'failed')",
    "CREATE INDEX ix_router_outbox_due ON router_outbox (target, available_at)"
    " WHERE status = 'failed'",
)

PREVIOUS_INDEXES = (
    "CREATE INDEX ix_router_outbox_claim ON router_outbox (target, seq)"
    " WHERE status IN ('pending', 'processing', 'failed')",
    "CREATE INDEX ix_router_outbox_stream ON router_outbox (target, stream_key, seq)"
    " WHERE status IN ('processing', 'failed') AND stream_key IS NOT NULL",
    "CREATE INDEX ix_router_outbox_due ON router_outbox (target, available_at)"
    " WHERE status IN ('pending', 'processing', 'failed')",
)

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
        attempts = u.attempts + 1, last_attempt_at = now()
    WHERE u.seq = ANY (ARRAY(SELECT picked.seq FROM picked))
    RETURNING u.seq, u.message_id::text, u.destination, u.envelope::text, u.attempts,
              u.stream_key, extract(epoch FROM u.created_at)::double precision;
END
$$
"""

# 0007's claim, as downgrade() puts it back.
PREVIOUS_CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION router_claim(p_target text, p_limit integer, p_worker text,
                                        p_lease_seconds double precision, p_token bigint
                                        , p_async boolean)
RETURNS TABLE (seq bigint, message_id text, destination text, envelope text,
               attempts integer, stream_key text, created_at double precision)
LANGUAGE plpgsql AS $$
BEGIN
    -- A lost claim only leaves its rows pending: no need to wait for the WAL flush.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
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
          -- Start at the first open row: whichever index the planner picks then skips the
          -- published history instead of walking it (statistics cannot tell it lies first).
          AND o.seq >= (SELECT min(f.seq) FROM router_outbox f
                        WHERE f.target = p_target
                          AND f.status IN ('pending', 'processing', 'failed'))
          AND o.status IN ('pending', 'processing', 'failed')
          AND CASE WHEN o.status = 'processing' THEN o.locked_until ELSE o.available_at END
              <= now()
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


NO_STATISTICS = """
ALTER TABLE router_outbox
    ALTER COLUMN target SET STATISTICS 0, ALTER COLUMN target TYPE text,
    ALTER COLUMN status SET STATISTICS 0, ALTER COLUMN status TYPE text
"""

DEFAULT_STATISTICS = """
ALTER TABLE router_outbox
    ALTER COLUMN target SET STATISTICS -1, ALTER COLUMN status SET STATISTICS -1
"""


def _rebuild(indexes: tuple[str, ...], statistics: str) -> None:
    for name in ("ix_router_outbox_claim", "ix_router_outbox_stream", "ix_router_outbox_due"):
        op.execute(f"DROP INDEX {name}")
    op.execute(statistics)
    for statement in indexes:
        op.execute(statement)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _rebuild(INDEXES, NO_STATISTICS)
        op.execute(CLAIM_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _rebuild(PREVIOUS_INDEXES, DEFAULT_STATISTICS)
        op.execute(PREVIOUS_CLAIM_FUNCTION)
