"""The router's own bookkeeping may commit without waiting for the WAL flush.

- ``router_claim()`` takes ``p_async``: when true it sets ``synchronous_commit = off`` for its
  own transaction;
- ``router_mark()`` writes a batch's outcomes (published, failed with its delay, abandoned,
  untried) in one call, fenced by the claim's token, with the same ``p_async``.

The router passes ``p_async = NOT outbox.durable_bookkeeping`` (off by default).

Why it is safe: only the router's claims and marks commit asynchronously, never a row an
application stages. If PostgreSQL crashes, it may forget the last few of them (WAL keeps
them in order, so what is lost is always the most recent ones): a forgotten claim leaves its
rows pending, a forgotten mark leaves its rows leased until the lease ends. Either way the
rows are delivered again (at least once; brokers drop repeats by message id), in order. What
it saves: every claim and every mark waited for an fsync, which on a commodity disk is the
larger part of the commit-to-broker latency.

``set_config(..., true)`` lasts until the end of the calling transaction only, so a pooled
session (PgBouncer, say) never carries the setting over to an application.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Literal copies of what this revision installs (migrations are history and load nothing
# of the project; the current text, with its reasons, is router/relay/store/postgres_sql.py).

# 0005's claim, with the p_async parameter and the statement that uses it.
CLAIM_FUNCTION = """
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
    FROM picked
    WHERE u.seq = picked.seq
    RETURNING u.seq, u.message_id::text, u.destination, u.envelope::text, u.attempts,
              u.stream_key, extract(epoch FROM u.created_at)::double precision;
END
$$
"""

MARK_FUNCTION = """
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

# 0005's claim, as downgrade() puts it back.
PREVIOUS_CLAIM_FUNCTION = """
CREATE OR REPLACE FUNCTION router_claim(p_target text, p_limit integer, p_worker text,
                                        p_lease_seconds double precision, p_token bigint
                                        )
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

MARK_SIGNATURE = (
    "router_mark(bigint, bigint[], bigint[], double precision[], text[], bigint[], text[], "
    "bigint[], boolean)"
)
CLAIM_ARGUMENTS = "text, integer, text, double precision, bigint"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # A new argument makes a new function: drop 0005's, or calls would be ambiguous.
        op.execute(f"DROP FUNCTION router_claim({CLAIM_ARGUMENTS})")
        op.execute(CLAIM_FUNCTION)
        op.execute(MARK_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {MARK_SIGNATURE}")
        op.execute(f"DROP FUNCTION router_claim({CLAIM_ARGUMENTS}, boolean)")
        op.execute(PREVIOUS_CLAIM_FUNCTION)
