"""Claims that stay fast on a large table.

- The claim starts at the target's first open row (found through the partial claim index),
  so no plan walks the primary key through every published row (which the planner chose
  once the statistics said most rows were pending).
- Autovacuum visits the outbox after 1% of it changed (not 20%) and without throttling: every
  delivered row leaves two dead versions in the claim index, and a claim walks past them
  until vacuum removes them.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
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
    FROM picked
    WHERE u.seq = picked.seq
    RETURNING u.seq, u.message_id::text, u.destination, u.envelope::text, u.attempts,
              u.stream_key, extract(epoch FROM u.created_at)::double precision;
END
$$
"""


AUTOVACUUM = """
ALTER TABLE router_outbox SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_analyze_scale_factor = 0.02
)
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CLAIM_FUNCTION)
        op.execute(AUTOVACUUM)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "ALTER TABLE router_outbox RESET (autovacuum_vacuum_scale_factor, "
            "autovacuum_vacuum_threshold, autovacuum_vacuum_cost_delay, "
            "autovacuum_analyze_scale_factor)"
        )
