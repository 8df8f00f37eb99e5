"""The PostgreSQL claim and mark as the newest migration installs them, clause by clause.

``router_claim()`` is the PostgreSQL twin of the SQLite claim (``router.relay.store.sqlite.CLAIM``);
``router_mark()`` writes a batch's outcomes. Migrations 0002 to 0009 built them a step at a
time, and each keeps a literal copy of what it installed, as history. This module is the text
head installs, in one place, with why each clause is there (the ``#`` comments: anything
inside the strings is part of the function bodies). The router calls the functions by name
(``router.relay.store.postgres.CLAIM`` and ``MARK``) and never sends this text;
tests/integration/test_claim_sql.py upgrades a fresh database and checks that the migrations
installed exactly this, so changing either one means changing both.
"""

from __future__ import annotations

__all__ = ["CLAIM_FUNCTION", "CLAIM_LOCK_NAMESPACE", "MARK_FUNCTION"]

CLAIM_LOCK_NAMESPACE = 1869903203
"""First key of the per-target advisory lock a claim takes. The router's other advisory
locks (``router.write.staging.STREAM_LOCK_NAMESPACE``, one per stream key while staging) use
another namespace, so a claim never waits on a stager."""


CLAIM_FUNCTION = (
    # One function, so a claim is one round trip (0002). p_token is the claim's fencing token:
    # marks apply only to rows still carrying it (0002). p_async: see below (0006).
    # created_at comes back as epoch seconds, for commit-to-ack latency.
    # The SET clauses (0008): the plan must be index-served whatever the statistics say. A
    # fresh outbox has none (autovacuum may be off, or not yet run), and PL/pgSQL keeps a
    # generic plan after five calls; without them the planner was free to read the target's
    # whole claim index per candidate row, or to aggregate over it for min(seq), and a claim
    # then cost time in proportion to every row the target had ever delivered.
    """
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
"""
    # The router passes p_async = NOT outbox.durable_bookkeeping. If PostgreSQL crashes it
    # may forget the last few claims, which only leaves their rows pending, and it saves an
    # fsync per claim. set_config(..., true) lasts until the end of this transaction, so a
    # pooled session never carries it over to an application (0006); the function's own SET
    # clauses restore only the settings they name.
    """\
    -- A lost claim only leaves its rows pending: no need to wait for the WAL flush.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
"""
    # Per-target lock, then the claim in a statement of its own: that statement sees every
    # claim committed before it, so a row is never claimed while an earlier row of its stream
    # is in flight under a claim that committed a moment ago (0002).
    f"""\
    -- Claims of one target take turns; the statements below then start with a snapshot that
    -- includes every claim committed before this one.
    PERFORM pg_advisory_xact_lock({CLAIM_LOCK_NAMESPACE}, hashtext(p_target));
"""
    # A paused target is not claimed by any worker (0003).
    """\
    IF EXISTS (SELECT 1 FROM router_targets t WHERE t.target = p_target AND t.paused) THEN
        RETURN;
    END IF;
"""
    # A lease that ran out (its worker died, or stalled past its heartbeat) puts the row back
    # in the queue, its attempt counted (it may have reached the broker), due now. Until 0008
    # such rows were claimed as they were; giving them back first keeps 'processing' rows out
    # of the claim index, so a claim moves a row out of that index instead of adding to it.
    # ix_router_outbox_stream holds the in-flight rows and serves this.
    """\
    UPDATE router_outbox
    SET status = 'failed', available_at = now(),
        last_error = 'lease ended before the attempt was marked (' || locked_by || ')',
        locked_by = NULL, locked_until = NULL
    WHERE target = p_target AND status = 'processing' AND locked_until <= now();
    RETURN QUERY
    WITH picked AS (
        SELECT o.seq FROM router_outbox o
        WHERE o.target = p_target
"""
    # Once the statistics say most rows are pending, the planner would walk the primary key
    # through every published row; starting at the target's first queued row (found through
    # the partial claim index) avoids that on a large table (0005).
    """\
          -- Start at the first queued row: whichever index the planner picks then skips the
          -- published history instead of walking it (statistics cannot tell it lies first).
          AND o.seq >= (SELECT min(f.seq) FROM router_outbox f
                        WHERE f.target = p_target AND f.status IN ('pending', 'failed'))
"""
    # Queued and due: pending, or failed once its retry delay has passed. Word for word the
    # predicate of ix_router_outbox_claim (target, seq), which serves both this and min().
    """\
          AND o.status IN ('pending', 'failed') AND o.available_at <= now()
"""
    # Streams stay in order: a row waits while an earlier row of its stream is in flight
    # under a live lease or waiting to retry. Only ix_router_outbox_stream (in-flight and
    # failed rows by target, stream, seq) can serve this: the claim index leaves
    # 'processing' out (0008), so the planner has no whole-index scan to pick by mistake.
    """\
          AND (o.stream_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM router_outbox p
                WHERE p.target = o.target AND p.stream_key = o.stream_key AND p.seq < o.seq
                  AND p.status IN ('processing', 'failed')
                  AND CASE WHEN p.status = 'processing' THEN p.locked_until ELSE p.available_at END
                      > now()))
"""
    # Outbox order, in the claim index's order (target, seq). SKIP LOCKED: any number of
    # processors of one target never hold the same row at once, nor wait on each other.
    """\
        ORDER BY o.target, o.seq
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
"""
    # The lease: this worker and token until now + p_lease_seconds; attempts counts this
    # attempt, last_attempt_at feeds the retry rate and abandoned-row retention (0003);
    # first_attempt_at is for `router trace` (0009).
    """\
    UPDATE router_outbox AS u
    SET status = 'processing', locked_by = p_worker, lease_token = p_token,
        locked_until = now() + make_interval(secs => p_lease_seconds),
        attempts = u.attempts + 1, last_attempt_at = now(),
        first_attempt_at = coalesce(u.first_attempt_at, now())
"""
    # The picked rows by primary key, not joined back to the table: a join hashed the whole
    # table on outboxes of some tens of thousands of rows (0007).
    """\
    WHERE u.seq = ANY (ARRAY(SELECT picked.seq FROM picked))
"""
    # RETURNING promises no order: the caller sorts by seq.
    """\
    RETURNING u.seq, u.message_id::text, u.destination, u.envelope::text, u.attempts,
              u.stream_key, extract(epoch FROM u.created_at)::double precision;
END
$$
"""
)

MARK_FUNCTION = (
    # A batch's outcomes in one round trip (0006): failed rows come as parallel arrays of
    # seq, delay in seconds and error; abandoned ones as seq and error; published ones as
    # seq and the broker's receipt, or NULL where the broker gives none (0009).
    # No nested loop (0009): joined to its outcomes' arrays, a batch's rows must be paired by
    # hashing the arrays once. Without statistics the planner expects one row from the table
    # and loops over the unnested array for each row instead: for 500 rows, 250,000
    # comparisons, 50 ms a mark instead of 5.
    """
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
"""
    # As in the claim: a lost mark leaves its rows leased until the lease ends, and then they
    # are delivered again (at least once; brokers drop repeats by message id) (0006).
    """\
    -- A lost mark only means its rows are delivered again once their lease ends.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
"""
    # Every UPDATE below is fenced by the claim's token and 'processing': a worker that lost
    # its lease (paused, partitioned, expired) cannot mark rows another claim now holds
    # (0002). An empty outcome sends no statement.
    """\
    IF cardinality(p_published) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'published', published_at = now(), last_error = NULL,
            locked_by = NULL, locked_until = NULL, receipt = t.receipt
        FROM unnest(p_published, p_receipts) AS t(seq, receipt)
"""
    # The rows are found by primary key from the array (seq = ANY), as before receipts; the
    # join to the receipts only matches each to its own (0009).
    """\
        WHERE o.seq = ANY(p_published) AND o.seq = t.seq
          AND o.lease_token = p_token AND o.status = 'processing';
    END IF;
"""
    # Failed: due again after its own retry delay.
    """\
    IF cardinality(p_failed) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'failed', available_at = now() + make_interval(secs => t.delay),
            last_error = t.error, locked_by = NULL, locked_until = NULL
        FROM unnest(p_failed, p_delays, p_failed_errors) AS t(seq, delay, error)
        WHERE o.seq = t.seq AND o.lease_token = p_token AND o.status = 'processing';
    END IF;
"""
    # Abandoned: no longer open, so never claimed again.
    """\
    IF cardinality(p_abandoned) > 0 THEN
        UPDATE router_outbox AS o
        SET status = 'abandoned', last_error = t.error, locked_by = NULL, locked_until = NULL
        FROM unnest(p_abandoned, p_abandoned_errors) AS t(seq, error)
        WHERE o.seq = t.seq AND o.lease_token = p_token AND o.status = 'processing';
    END IF;
"""
    # Untried (held back behind a failed row of its stream, or released): back to what it
    # was before this claim, 'failed' when an earlier attempt had failed, else 'pending'.
    """\
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
)
