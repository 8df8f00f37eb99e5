"""The PostgreSQL claim and mark as the newest migration installs them, clause by clause.

``router_claim()`` is the PostgreSQL twin of the SQLite claim (``router.relay.store.sqlite.CLAIM``);
``router_mark()`` writes a batch's outcomes. Migrations 0002 to 0010 built them a step at a
time, and each keeps a literal copy of what it installed, as history. This module is the text
head installs, in one place, with why each clause is there (the ``#`` comments: anything
inside the strings is part of the function bodies). The router calls the functions by name
(``router.relay.store.postgres.CLAIM`` and ``MARK``) and never sends this text;
tests/integration/test_claim_sql.py upgrades a fresh database and checks that the migrations
installed exactly this, so changing either one means changing both.

Since 0016 both also keep ``router_gaps``, the gap markers of streams whose head was
abandoned (docs/guarantees.md): the mark records a gap when it abandons a row with a stream
key and deletes the gaps a published row named; the claim names, per row, the gaps before
it on its stream (``skipped``).

Since 0017 a stream's head that its target's ``ordering`` keeps (``held``, or ``parked`` with
the rest of its stream) holds back the later rows of its stream as a failed row does, for as
long as it stays so; the mark writes those outcomes, and parks a parked head's followers; the
claim parks the rows it finds staged behind a parked row since.

Since 0020 the claim returns each row's transaction id (``xid``): the unit an atomic target
publishes its rows in (``router.relay.store.units``), read with the row at no cost instead of
looked up again by seq, which on the partitioned queue no index serves by seq alone.

Since 0021 a pending row is due whatever its ``available_at``: only a failed row waits for
its time, and it holds its stream back while it waits.

Since 0022 the mark plans its statements once a session (``plan_cache_mode``), not on every
call.
"""

from __future__ import annotations

from router._schema import FN_CLAIM, FN_MARK, GAPS, OUTBOX, OUTBOX_QUEUE, RING, TARGETS

__all__ = [
    "CLAIM_FUNCTION",
    "CLAIM_LOCK_NAMESPACE",
    "MARK_FUNCTION",
    "RING_CHUNK_BITS",
    "RING_SLOTS",
    "SLOT_OF",
]

CLAIM_LOCK_NAMESPACE = 1869903203
"""First key of the per-target advisory lock a claim takes. The router's other advisory
locks (``router.write.postgres.STREAM_LOCK_NAMESPACE``, one per stream key's slot while
staging) use another namespace, so a claim never waits on a stager."""


RING_SLOTS = 8
"""Partitions of the queue (migration 0011): router_outbox_q0 to router_outbox_q7."""

RING_CHUNK_BITS = 15
"""Rows go to the queue partition of their seq's chunk of 2**15 (32,768) seqs, in turn:
``(seq >> 15) & 7``. A slot whose rows are all finished is truncated while the next chunks
fill the others (router/relay/store/postgres_ring.py)."""

SLOT_OF = f"((seq >> {RING_CHUNK_BITS}) & {RING_SLOTS - 1})"
"""The queue's partition key, as PostgreSQL must see it in a WHERE clause to prune by it."""


CLAIM_FUNCTION = (
    # One function, so a claim is one round trip (0002). created_at comes back as epoch
    # seconds, for commit-to-ack latency.
    # The claim writes nothing (0010): the caller runs it in a transaction of its own and
    # keeps that transaction open while it publishes; router_mark() then writes each row's
    # outcome and the caller commits. The row locks taken here are the batch's lease: no
    # other claim, requeue or discard touches the rows meanwhile, and if the worker dies its
    # connection closes and PostgreSQL rolls the transaction back, so the rows are at once
    # queued as they were. Before 0010 the claim wrote every row ('processing', a lease
    # token and its end) and the mark wrote it again: two new versions of every row, each
    # with its index entries, where one suffices (half the database's work per row).
    # The SET clauses (0008): the plan must be index-served whatever the statistics say. A
    # fresh outbox has none (autovacuum may be off, or not yet run), and PL/pgSQL keeps a
    # generic plan after five calls; without them the planner was free to read the target's
    # whole claim index per candidate row, or to aggregate over it for min(seq), and a claim
    # then cost time in proportion to every row the target had ever delivered.
    f"""
CREATE OR REPLACE FUNCTION {FN_CLAIM}(p_target text, p_limit integer, p_worker text,
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
"""
    # The router passes p_async = NOT outbox.durable_bookkeeping. If PostgreSQL crashes it
    # may forget the last few marks, which only leaves their rows queued, to be delivered
    # again, and it saves an fsync per batch. set_config(..., true) lasts until the end of
    # this transaction, so it covers the commit after router_mark(), and a pooled session
    # never carries it over to an application (0006).
    """\
    -- A lost batch only leaves its rows queued: no need to wait for the WAL flush.
    IF p_async THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
"""
    # The session shows which worker holds the batch (pg_stat_activity.application_name, with
    # the target's lock in pg_locks) until the batch ends (0010).
    """\
    PERFORM set_config('application_name', p_worker, true);
"""
    # A worker that stops answering (stopped, or its host partitioned away) while its
    # connection stays open would hold its rows, and every claim of the target behind the
    # lock below, for as long as TCP keeps the connection. The server ends its session once
    # it has been idle in this transaction for p_hold_seconds (outbox.lease_seconds; a live
    # worker sends a statement before each wave of a long batch), and the rows are queued
    # again (0010).
    """\
    -- A worker that goes silent for p_hold_seconds loses its session, and so its rows.
    PERFORM set_config('idle_in_transaction_session_timeout',
                       (ceil(p_hold_seconds * 1000))::bigint::text, true);
"""
    # Per-target lock, held until the batch is marked and committed (0010; 0002 held it for
    # the claim alone). Batches of one target therefore take turns, across every worker and
    # host, and a claim starts with a snapshot that includes the previous batch's outcomes.
    # That keeps streams in order: a row is never sent while an earlier row of its stream is
    # being sent in another batch, or had just failed there.
    # A claim that finds the lock taken does not wait for it: it answers at once with one row
    # whose seq is NULL (busy), and the caller asks again later. A claim waiting in the server
    # would take the lock the moment it is free, whether or not its worker is still there to
    # use it: a host that froze with claims queued would hold the target for lease_seconds
    # once per queued claim.
    # While the ring's recycler truncates finished queue slots, every claim answers busy
    # (0011): runs end with the batch they publish, their locks on the slots go, and the
    # TRUNCATE waits for one batch at most, not for a run. gate_until lapses by itself, so a
    # recycler that died leaves no gate shut.
    f"""\
    -- Busy while finished queue slots are being emptied ({RING}.gate_until).
    IF EXISTS (SELECT 1 FROM {RING} r WHERE r.id AND r.gate_until > clock_timestamp()) THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::integer,
                            NULL::text, NULL::double precision, NULL::bigint,
                            NULL::text[];
        RETURN;
    END IF;
"""
    f"""\
    -- Batches of one target take turns: busy (a NULL seq) while another is in flight.
    IF NOT pg_try_advisory_xact_lock({CLAIM_LOCK_NAMESPACE}, hashtext(p_target)) THEN
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::integer,
                            NULL::text, NULL::double precision, NULL::bigint,
                            NULL::text[];
        RETURN;
    END IF;
"""
    # A paused target is not claimed by any worker (0003).
    f"""\
    IF EXISTS (SELECT 1 FROM {TARGETS} t WHERE t.target = p_target AND t.paused) THEN
        RETURN;
    END IF;
"""
    # Whether any stream of the target is held back right now (0013). Most of the time none
    # is, and then no candidate needs the check below: it cost one probe of every queue slot's
    # stream index per candidate (8 of 8.6 thousand buffers a 500-row claim read, and a fifth
    # of the database's CPU per delivered row). The answer holds for the whole claim: only
    # the holder of the target's lock, taken above, marks its rows failed, and in a run of
    # batches this transaction's own marks are visible to both statements.
    # A held or parked row (0017) holds its stream back for good, until an operator releases
    # it: its time is 'infinity'. The status list is ix_router_outbox_stream's predicate, word
    # for word, here and below.
    f"""\
    v_held_back := EXISTS (
        SELECT 1 FROM {OUTBOX_QUEUE} p
        WHERE p.target = p_target AND p.status IN ('processing', 'failed', 'held', 'parked')
          AND CASE WHEN p.status = 'processing' THEN p.locked_until
                   WHEN p.status = 'failed' THEN p.available_at
                   ELSE 'infinity' END > now());
"""
    # Rows staged on a parked stream after its head was parked are parked as they come
    # (0017): the claim parks those among the first p_limit queued rows it would look at (the
    # rows it would otherwise walk past), so a claim does at most a batch of this work, and a
    # parked stream's rows leave the claim index as claims reach them. Asked only while a
    # stream of the target is held back at all (above): a target with none pays nothing for
    # it, and one without a parked row one probe of the stream index. SKIP LOCKED: a row an
    # operator's release holds this moment is left to it.
    f"""\
    IF v_held_back AND EXISTS (
        SELECT 1 FROM {OUTBOX_QUEUE} p WHERE p.target = p_target AND p.status = 'parked')
    THEN
        WITH first_queued AS (
            SELECT c.seq, c.stream_key FROM {OUTBOX_QUEUE} c
            WHERE c.target = p_target AND c.seq > p_after
              AND c.status IN ('pending', 'failed')
            ORDER BY c.target, c.seq
            LIMIT p_limit
        ), behind_parked AS (
            SELECT x.seq FROM {OUTBOX_QUEUE} x
            WHERE x.target = p_target AND x.status IN ('pending', 'failed')
              AND x.seq IN (
                SELECT w.seq FROM first_queued w
                WHERE w.stream_key IS NOT NULL AND EXISTS (
                    SELECT 1 FROM {OUTBOX_QUEUE} p
                    WHERE p.target = p_target AND p.stream_key = w.stream_key
                      AND (p.target, p.stream_key, p.seq) < (p_target, w.stream_key, w.seq)
                      AND p.status = 'parked'))
            FOR UPDATE SKIP LOCKED
        )
        UPDATE {OUTBOX_QUEUE} AS o SET status = 'parked'
        FROM behind_parked b
        WHERE o.target = p_target AND o.seq = b.seq AND o.status IN ('pending', 'failed');
    END IF;
"""
    # Whether the target has any gap marker at all (0016), asked once for the claim, as the
    # held-back check above is: almost always it has none, and then no row looks for its
    # stream's gaps below (one probe of router_gaps' primary key per claim, not per row). The
    # answer holds for the claim: gaps are written by marks of the target, which take turns
    # with this claim on the target's lock, and by operators' requeues, which only remove.
    f"""\
    v_gaps := EXISTS (SELECT 1 FROM {GAPS} g WHERE g.target = p_target);
    RETURN QUERY
    WITH picked AS (
        SELECT o.seq, o.message_id::text, o.destination, o.envelope::text, o.attempts + 1,
               o.stream_key, extract(epoch FROM o.created_at)::double precision,
               o.xid::text::bigint
        FROM {OUTBOX_QUEUE} o
        WHERE o.target = p_target
"""
    # Once the statistics say most rows are pending, the planner would walk the primary key
    # through every published row; starting at the target's first queued row (found through
    # the partial claim index) avoids that on a large table (0005). Since 0011 the claim reads
    # the queue partitions alone (router_outbox_queue: unfinished rows; published history is
    # in router_outbox_done), and min() starts after p_after: the claim index still holds the
    # entries of rows published since their slot was last emptied, and while a long
    # transaction holds the xmin horizon nothing marks them dead, so min() would visit each.
    f"""\
          -- Start at the first queued row: whichever index the planner picks then skips the
          -- published history instead of walking it (statistics cannot tell it lies first).
          AND o.seq >= (SELECT min(f.seq) FROM {OUTBOX_QUEUE} f
                        WHERE f.target = p_target AND f.seq > p_after
                          AND f.status IN ('pending', 'failed'))
"""
    # A batch claimed in the transaction of the one before it (p_after: that batch's last
    # seq; 0 for the first of a transaction) takes the rows after it: the earlier batch's rows
    # are this transaction's own, locked and not yet marked, so SKIP LOCKED would not pass
    # over them. Every queued row before p_after was in that batch or waits behind its
    # stream (0010).
    """\
          AND o.seq > p_after
"""
    # Queued and due: pending, or failed once its retry delay has passed. The status list is
    # word for word the predicate of ix_router_outbox_claim (target, seq), which serves both
    # this and min(). A pending row is due whatever its time (0021): only a failed row waits
    # for one, and it holds its stream back meanwhile. A pending row's time can read later
    # than this transaction's now(): a staging transaction that began before this one and
    # committed since, or a release stamped by a clock ahead of the server's. Such a row
    # held nothing back, so the rows behind it on its stream went first.
    """\
          AND o.status IN ('pending', 'failed')
          AND (o.status = 'pending' OR o.available_at <= now())
"""
    # Streams stay in order: a row waits while an earlier row of its stream waits to retry.
    # Only ix_router_outbox_stream (failed rows, and rows 'processing' under a lease before
    # 0010, by target, stream, seq) can serve this: the claim index leaves 'processing' out
    # (0008), so the planner has no whole-index scan to pick by mistake. No row is
    # 'processing' since 0010 (the migration queued them again); the predicate stays that
    # index's, word for word. The earlier seq is a row comparison on that index's columns
    # (0012): a plain ``p.seq < o.seq`` let a slot's unique seq index serve the check, and a
    # plan that took it walked, for every candidate, every entry of the slot before it (dead
    # ones too, while the xmin horizon is held): claims of 100-800 ms in bench.xmin_hold.
    # Since 0017 a held or parked row holds its stream back too, for good (its time is
    # 'infinity'), and the index holds those rows as well.
    f"""\
          AND (NOT v_held_back OR o.stream_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM {OUTBOX_QUEUE} p
                WHERE p.target = o.target AND p.stream_key = o.stream_key
                  AND (p.target, p.stream_key, p.seq) < (o.target, o.stream_key, o.seq)
                  AND p.status IN ('processing', 'failed', 'held', 'parked')
                  AND CASE WHEN p.status = 'processing' THEN p.locked_until
                           WHEN p.status = 'failed' THEN p.available_at
                           ELSE 'infinity' END > now()))
"""
    # Outbox order, in the claim index's order (target, seq). The row locks are the batch's
    # lease (see above); SKIP LOCKED passes over a row an operator's requeue or discard holds
    # this moment. attempts + 1: this attempt counts, as it will once router_mark() writes it.
    """\
        ORDER BY o.target, o.seq
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
"""
    # Each keyed row names the gaps before it on its stream, oldest first (0016): the message
    # ids of rows of the stream abandoned on this target and not yet reported by a row
    # published after them. router_gaps' primary key (target, stream_key, seq) serves it. A
    # CASE evaluates the lookup only when its condition holds, so a claim of a target
    # without gaps reads router_gaps once, above.
    f"""\
    SELECT picked.*,
           CASE WHEN v_gaps AND picked.stream_key IS NOT NULL THEN ARRAY(
               SELECT g.message_id::text FROM {GAPS} g
               WHERE g.target = p_target AND g.stream_key = picked.stream_key
                 AND g.seq < picked.seq
               ORDER BY g.seq) END
    FROM picked;
END
$$
"""
)


# A batch's rows of one queue slot (v_slot): the first two tests name the partition keys.
_THIS_SLOT = f"""NOT (o.status IN ('published', 'abandoned'))
              AND {SLOT_OF.replace("seq", "o.seq")} = v_slot"""

MARK_FUNCTION = (
    # A batch's outcomes in one round trip (0006), in the claim's transaction (0010): failed
    # rows come as parallel arrays of seq, delay in seconds and error; abandoned ones as seq
    # and error; published ones as seq and the broker's receipt, or NULL where the broker
    # gives none (0009). Each row is written once, with the attempt it was claimed for
    # (attempts, first and last attempt): the claim wrote nothing. Rows claimed but not sent
    # (held back behind a failed row of their stream) need no statement: the commit releases
    # their locks and they are queued as they were, their attempt not counted.
    # No fencing token (0002 to 0009): the rows are locked by this transaction, so no other
    # claim can have taken them over; if the session ended (idle timeout, network), this
    # call fails and the transaction with it.
    # No nested loop (0009): joined to its outcomes' arrays, a batch's rows must be paired by
    # hashing the arrays once. Without statistics the planner expects one row from the table
    # and loops over the unnested array for each row instead: for 500 rows, 250,000
    # comparisons, 50 ms a mark instead of 5. No sequential scan (0010): once the claim stopped
    # writing the rows, a fresh table's missing statistics made a 3,000-row outbox look cheaper
    # to read whole than by its primary key.
    # Times from the clock (0010): now() is when the transaction began, with the claim of the
    # first batch of its run; an attempt's time, and when the next is due, count from now.
    # One queue slot at a time (0011): the rows are unfinished, so they are in
    # router_outbox_queue, in the slot of their seq. Written with the partition keys (the
    # status test and the slot), the statement reads that slot's seq index alone; otherwise
    # each of the nine partitions would be searched for every seq. A published or
    # abandoned row moves to router_outbox_done (its one write: PostgreSQL deletes it from the
    # slot and inserts it there); a failed one stays in its slot.
    # The gap markers (0016): p_target, and the stream key and message id of each gap that a
    # published row of the batch named (its ``skipped``), to be deleted with the marks.
    # The held and parked stream heads (0017), as seq and error, as the abandoned ones come.
    # One plan per statement for the session (0022): PL/pgSQL planned each UPDATE afresh on
    # every call, because a custom plan, priced under the SETs above, always looked cheaper
    # than the generic one. Planning an UPDATE of the partitioned queue is most of a small
    # batch's mark: about 240 us a call for one row, 100 us with the generic plan, which
    # prunes the queue's slots as it starts and finds the rows by seq as the custom plans do
    # (tests/integration/test_claim_plans.py). For 500 rows, where planning is a small part,
    # the same (``bench.mark_cost``).
    f"""
CREATE OR REPLACE FUNCTION {FN_MARK}(p_published bigint[], p_receipts text[],
                                       p_failed bigint[], p_delays double precision[],
                                       p_failed_errors text[],
                                       p_abandoned bigint[], p_abandoned_errors text[],
                                       p_target text, p_reported_keys text[],
                                       p_reported_ids text[],
                                       p_held bigint[], p_held_errors text[],
                                       p_parked bigint[], p_parked_errors text[])
RETURNS void
LANGUAGE plpgsql
SET enable_nestloop = off
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    -- The time of the outcome; now() is the transaction's start, batches earlier.
    v_now timestamptz := clock_timestamp();
    v_slot bigint;
BEGIN
    FOR v_slot IN
        SELECT DISTINCT {SLOT_OF}
        FROM unnest(p_published || p_failed || p_abandoned || p_held || p_parked) AS seq
    LOOP
        IF cardinality(p_published) > 0 THEN
            UPDATE {OUTBOX} AS o
            SET status = 'published', published_at = v_now, last_error = NULL,
                receipt = t.receipt, attempts = o.attempts + 1, last_attempt_at = v_now,
                first_attempt_at = coalesce(o.first_attempt_at, v_now)
            FROM unnest(p_published, p_receipts) AS t(seq, receipt)
            WHERE {_THIS_SLOT}
              AND o.seq = ANY(p_published) AND o.seq = t.seq;
        END IF;
"""
    # Failed: due again after its own retry delay.
    f"""\
        IF cardinality(p_failed) > 0 THEN
            UPDATE {OUTBOX} AS o
            SET status = 'failed', available_at = v_now + make_interval(secs => t.delay),
                last_error = t.error, attempts = o.attempts + 1, last_attempt_at = v_now,
                first_attempt_at = coalesce(o.first_attempt_at, v_now)
            FROM unnest(p_failed, p_delays, p_failed_errors) AS t(seq, delay, error)
            WHERE {_THIS_SLOT}
              AND o.seq = ANY(p_failed) AND o.seq = t.seq;
        END IF;
"""
    # Abandoned: no longer open, so never claimed again. A row with a stream key leaves a gap
    # in its stream (0016), recorded in the same statement: the rows after it are published,
    # and the next of them names it (router_claim()'s skipped). ON CONFLICT: a gap is recorded
    # once, however often its row is abandoned again after a requeue that kept it.
    f"""\
        IF cardinality(p_abandoned) > 0 THEN
            WITH abandoned AS (
                UPDATE {OUTBOX} AS o
                SET status = 'abandoned', last_error = t.error, attempts = o.attempts + 1,
                    last_attempt_at = v_now,
                    first_attempt_at = coalesce(o.first_attempt_at, v_now)
                FROM unnest(p_abandoned, p_abandoned_errors) AS t(seq, error)
                WHERE {_THIS_SLOT}
                  AND o.seq = ANY(p_abandoned) AND o.seq = t.seq
                RETURNING o.target, o.stream_key, o.seq, o.message_id
            )
            INSERT INTO {GAPS} (target, stream_key, seq, message_id, abandoned_at)
            SELECT a.target, a.stream_key, a.seq, a.message_id, v_now
            FROM abandoned a WHERE a.stream_key IS NOT NULL
            ON CONFLICT DO NOTHING;
        END IF;
"""
    # Held (0017): the head of a stream on a target whose ordering is hold. It stays in the
    # queue with its error, holds its stream back until an operator releases it, and leaves
    # no gap: nothing after it is sent.
    f"""\
        IF cardinality(p_held) > 0 THEN
            UPDATE {OUTBOX} AS o
            SET status = 'held', last_error = t.error, attempts = o.attempts + 1,
                last_attempt_at = v_now, first_attempt_at = coalesce(o.first_attempt_at, v_now)
            FROM unnest(p_held, p_held_errors) AS t(seq, error)
            WHERE {_THIS_SLOT}
              AND o.seq = ANY(p_held) AND o.seq = t.seq;
        END IF;
"""
    # Parked (0017): the head of a stream on a target whose ordering is park, and in the same
    # statement every later queued row of its stream on the target, wherever its slot (rows of
    # this run's later batches among them: this transaction holds them, unsent), read through
    # the claim index from the head on: rare work, paid when a stream is parked. Rows staged
    # on the stream later are parked by the claims that find them (router_claim()).
    f"""\
        IF cardinality(p_parked) > 0 THEN
            WITH heads AS (
                UPDATE {OUTBOX} AS o
                SET status = 'parked', last_error = t.error, attempts = o.attempts + 1,
                    last_attempt_at = v_now,
                    first_attempt_at = coalesce(o.first_attempt_at, v_now)
                FROM unnest(p_parked, p_parked_errors) AS t(seq, error)
                WHERE {_THIS_SLOT}
                  AND o.seq = ANY(p_parked) AND o.seq = t.seq
                RETURNING o.target, o.stream_key, o.seq
            )
            UPDATE {OUTBOX_QUEUE} AS f SET status = 'parked'
            FROM heads h
            WHERE f.target = p_target AND f.status IN ('pending', 'failed')
              AND f.stream_key = h.stream_key AND f.seq > h.seq;
        END IF;
    END LOOP;
"""
    # A published row named these gaps, so its consumer knows of them: they are closed (0016).
    # After the abandoned rows' gaps, which a later row of the same batch may have named
    # already. The stream keys only lead router_gaps' primary key to the rows: a message id
    # is one row's of the target, so it names one gap. The ids are cast once and hashed
    # (0022): under the generic plan a test against ``p_reported_ids::uuid[]`` cast the whole
    # array again for every gap row, so closing a gap of 5,000 rows took 10 s, not 8 ms.
    f"""\
    IF cardinality(p_reported_ids) > 0 THEN
        DELETE FROM {GAPS} g
        USING unnest(p_reported_ids::uuid[]) AS r(message_id)
        WHERE g.target = p_target AND g.stream_key = ANY(p_reported_keys)
          AND g.message_id = r.message_id;
    END IF;
END
$$
"""
)
