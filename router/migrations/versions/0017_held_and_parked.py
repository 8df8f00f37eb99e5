"""Held and parked stream heads: the ``hold`` and ``park`` orderings of a target.

Until this revision a row with a stream key that its broker refused for good, or that ran out
of attempts, was abandoned and its stream went on (the ``skip`` ordering, with the gap marker
of 0016). A target may now keep such a head instead (docs/guarantees.md):

- ``held`` (``ordering: hold``): the head stays queued with its error, and the later rows of its
  stream on its target wait, untried, until an operator releases it (``router release``);
- ``parked`` (``ordering: park``): the head and every later row of its stream on its target are
  set aside together, rows staged on the stream later too, until ``router release`` puts them
  back in order.

Both are new values of ``status`` (``ck_router_outbox_status``). A held or parked row is never
claimed, and holds back the later rows of its stream as a failed row does, for good: the
stream-order check now names them, so ``ix_router_outbox_stream``'s predicate does too.

On PostgreSQL both stay in the queue (the partition key puts only published and abandoned rows
in ``router_outbox_done``). The stream index is made again on each queue slot with the new
predicate, then on the queue, which attaches them (as 0011 made it). ``router_claim()`` asks,
in its held-back check, for held and parked rows too, and while a stream is held back and the
target has a parked row, parks the rows behind one among the first it would look at (rows
staged on a parked stream are parked as they come); ``router_mark()`` takes the held and
parked heads (new arguments: a new function, so the old one is dropped first) and parks a
parked head's later rows in the same statement. A CHECK constraint changed on the outbox is
validated against every row: the migration reads the whole table once (its history too).

On SQLite a CHECK constraint is part of the table's definition: the table is made again
(Alembic's batch mode, its rows copied, ``AUTOINCREMENT`` and the sequence kept) and the stream
index with the new predicate. On MySQL/MariaDB the constraint is replaced in one ALTER (the
server copies the table); the stream index there holds every status already.

The downgrade puts held and parked rows back to pending, due now (the code before this
revision delivers them, as ``skip`` would), then the constraint, the index and the functions
as 0016 left them.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from router.migrations.history import earlier

revision = "0017"
down_revision = "0016"
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

MARK_FUNCTION = """
CREATE OR REPLACE FUNCTION router_mark(p_published bigint[], p_receipts text[],
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
AS $$
DECLARE
    -- The time of the outcome; now() is the transaction's start, batches earlier.
    v_now timestamptz := clock_timestamp();
    v_slot bigint;
BEGIN
    FOR v_slot IN
        SELECT DISTINCT ((seq >> 15) & 7)
        FROM unnest(p_published || p_failed || p_abandoned || p_held || p_parked) AS seq
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
        IF cardinality(p_held) > 0 THEN
            UPDATE router_outbox AS o
            SET status = 'held', last_error = t.error, attempts = o.attempts + 1,
                last_attempt_at = v_now, first_attempt_at = coalesce(o.first_attempt_at, v_now)
            FROM unnest(p_held, p_held_errors) AS t(seq, error)
            WHERE NOT (o.status IN ('published', 'abandoned'))
              AND ((o.seq >> 15) & 7) = v_slot
              AND o.seq = ANY(p_held) AND o.seq = t.seq;
        END IF;
        IF cardinality(p_parked) > 0 THEN
            WITH heads AS (
                UPDATE router_outbox AS o
                SET status = 'parked', last_error = t.error, attempts = o.attempts + 1,
                    last_attempt_at = v_now,
                    first_attempt_at = coalesce(o.first_attempt_at, v_now)
                FROM unnest(p_parked, p_parked_errors) AS t(seq, error)
                WHERE NOT (o.status IN ('published', 'abandoned'))
              AND ((o.seq >> 15) & 7) = v_slot
                  AND o.seq = ANY(p_parked) AND o.seq = t.seq
                RETURNING o.target, o.stream_key, o.seq
            )
            UPDATE router_outbox_queue AS f SET status = 'parked'
            FROM heads h
            WHERE f.target = p_target AND f.status IN ('pending', 'failed')
              AND f.stream_key = h.stream_key AND f.seq > h.seq;
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

MARK_SIGNATURE = (
    "router_mark(bigint[], text[], bigint[], double precision[], text[], bigint[], text[], "
    "text, text[], text[], bigint[], text[], bigint[], text[])"
)
PREVIOUS_MARK_SIGNATURE = (
    "router_mark(bigint[], text[], bigint[], double precision[], text[], bigint[], text[], "
    "text, text[], text[])"
)

STATUSES = "'pending', 'processing', 'published', 'failed', 'abandoned', 'held', 'parked'"
PREVIOUS_STATUSES = "'pending', 'processing', 'published', 'failed', 'abandoned'"

# The rows that hold a stream back: the stream index's predicate (the claim's, word for word).
HOLDING_BACK = "status IN ('processing', 'failed', 'held', 'parked')"
PREVIOUS_HOLDING_BACK = "status IN ('processing', 'failed')"

SLOTS = 8

# Each database's clock, as its outbox stores times (SQLite: UTC text, as 0001's defaults).
NOW = {
    "postgresql": "now()",
    "mysql": "UTC_TIMESTAMP(6)",
    "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now')",
}


def _stream_index(predicate: str) -> list[str]:
    """PostgreSQL: ix_router_outbox_stream on each queue slot, then on the queue (which
    attaches the slots' indexes, as 0011 made them)."""
    return [
        *(
            f"CREATE INDEX ix_router_outbox_stream_q{slot} ON router_outbox_q{slot}"
            f" (target, stream_key, seq) WHERE {predicate}"
            for slot in range(SLOTS)
        ),
        "CREATE INDEX ix_router_outbox_stream ON router_outbox_queue (target, stream_key, seq)"
        f" WHERE {predicate}",
    ]


def _check(statuses: str) -> str:
    return f"status IN ({statuses})"


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        _postgres(STATUSES, HOLDING_BACK)
        op.execute(f"DROP FUNCTION {PREVIOUS_MARK_SIGNATURE}")
        op.execute(CLAIM_FUNCTION)
        op.execute(MARK_FUNCTION)
    elif dialect == "mysql":
        _mysql(STATUSES)
    else:
        _sqlite(STATUSES, HOLDING_BACK)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    # Back to the queue as pending, due now: before this revision nothing else may hold them.
    now = NOW[dialect]
    op.execute(
        f"UPDATE router_outbox SET status = 'pending', available_at = {now}"
        " WHERE status IN ('held', 'parked')"
    )
    if dialect == "postgresql":
        previous = earlier("0016_gap_markers.py")
        _postgres(PREVIOUS_STATUSES, PREVIOUS_HOLDING_BACK)
        op.execute(f"DROP FUNCTION {MARK_SIGNATURE}")
        op.execute(previous.CLAIM_FUNCTION)
        op.execute(previous.MARK_FUNCTION)
    elif dialect == "mysql":
        _mysql(PREVIOUS_STATUSES)
    else:
        _sqlite(PREVIOUS_STATUSES, PREVIOUS_HOLDING_BACK)


def _postgres(statuses: str, holding_back: str) -> None:
    op.execute(
        "ALTER TABLE router_outbox DROP CONSTRAINT ck_router_outbox_status,"
        f" ADD CONSTRAINT ck_router_outbox_status CHECK ({_check(statuses)})"
    )
    op.execute("DROP INDEX ix_router_outbox_stream")  # the queue's, with its slots'
    for statement in _stream_index(holding_back):
        op.execute(statement)


def _mysql(statuses: str) -> None:
    op.execute(
        "ALTER TABLE router_outbox DROP CONSTRAINT ck_router_outbox_status,"
        f" ADD CONSTRAINT ck_router_outbox_status CHECK ({_check(statuses)})"
    )


def _sqlite(statuses: str, holding_back: str) -> None:
    # The batch copies the rows into a new table: AUTOINCREMENT must be asked for again, and
    # the sequence it keeps set back to where it was (a table emptied by the retention
    # cleanup would otherwise hand out its seqs again).
    bind = op.get_bind()
    last = bind.execute(
        sa.text("SELECT seq FROM sqlite_sequence WHERE name = 'router_outbox'")
    ).scalar()
    with op.batch_alter_table(
        "router_outbox", recreate="always", table_kwargs={"sqlite_autoincrement": True}
    ) as table:
        table.drop_constraint("ck_router_outbox_status", type_="check")
        table.create_check_constraint("ck_router_outbox_status", _check(statuses))
    if last is not None:
        op.execute("DELETE FROM sqlite_sequence WHERE name = 'router_outbox'")
        op.execute(
            sa.text(
                "INSERT INTO sqlite_sequence (name, seq) SELECT 'router_outbox',"
                " max(:last, coalesce((SELECT max(seq) FROM router_outbox), 0))"
            ).bindparams(last=last)
        )
    op.drop_index("ix_router_outbox_stream", "router_outbox")
    where = sa.text(f"{holding_back} AND stream_key IS NOT NULL")
    op.create_index(
        "ix_router_outbox_stream",
        "router_outbox",
        ["target", "stream_key", "seq"],
        sqlite_where=where,
    )
