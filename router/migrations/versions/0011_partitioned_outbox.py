"""PostgreSQL: a partitioned outbox whose finished queue slots are truncated, not vacuumed.

Every delivered row leaves a dead version behind (its queued version, and that version's
entry in the claim index) that only VACUUM removes, and VACUUM removes none while any
transaction of the database holds an old snapshot (the xmin horizon): a long report, a
session idle in a transaction, a replication slot. Claims then read past more of them every
time, and the table and its indexes grow for as long as the snapshot lasts.

From this revision ``router_outbox`` is partitioned in two levels:

- ``router_outbox_done``: published and abandoned rows (the history kept for
  ``retention``; replay and the retention cleanup read it, no claim does).
- ``router_outbox_queue``: every other row, partitioned again into a ring of 8 slots,
  ``router_outbox_q0`` to ``router_outbox_q7``, by ``(seq >> 15) & 7``: consecutive chunks of
  32,768 seqs fill the slots in turn.

Marking a row published moves it to ``router_outbox_done`` (still one write). Once every row of
a slot is finished and new rows go to other slots, the router truncates the slot
(``router/relay/store/postgres_ring.py``): its dead versions go at once, whatever the xmin
horizon, where VACUUM would have had to wait. There is no DEFAULT partition: every seq and
status has its partition, so no insert can fail for want of one, and a slot that cannot be
truncated yet (a row still failing, a paused target) only keeps its rows; new chunks go on
into it beside them. Claims read ``router_outbox_queue`` and pass through a gate
(``router_ring.gate_until``) that lets the truncation wait for one batch, not a run.

The parent keeps its name and columns, so the application's INSERTs and every query of the
router work unchanged. A partitioned table cannot have a primary key on ``seq`` alone (the
partition key is an expression): ``router_outbox_done`` has unique indexes on ``seq`` and on
``(message_id, target)``, and the queue slots the claim's indexes only. Existing rows are
copied into the new table (the migration holds the outbox for that time; about a second per
100,000 rows) and the sequence goes on where it was.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

from router.migrations.history import earlier

revision = "0011"
down_revision = "0010"
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
          AND (o.stream_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM router_outbox_queue p
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
            UPDATE router_outbox AS o
            SET status = 'abandoned', last_error = t.error, attempts = o.attempts + 1,
                last_attempt_at = v_now, first_attempt_at = coalesce(o.first_attempt_at, v_now)
            FROM unnest(p_abandoned, p_abandoned_errors) AS t(seq, error)
            WHERE NOT (o.status IN ('published', 'abandoned'))
              AND ((o.seq >> 15) & 7) = v_slot
              AND o.seq = ANY(p_abandoned) AND o.seq = t.seq;
        END IF;
    END LOOP;
END
$$
"""


COLUMNS = (
    "seq, message_id, target, destination, event_type, stream_key, envelope, status, attempts, "
    "available_at, locked_by, locked_until, last_error, created_at, published_at, xid, "
    "lease_token, last_attempt_at, receipt, first_attempt_at"
)

# The columns as 0001 to 0009 made them, the defaults included.
COLUMN_DEFINITIONS = """
    seq bigint GENERATED BY DEFAULT AS IDENTITY NOT NULL,
    message_id uuid NOT NULL,
    target text NOT NULL,
    destination text NOT NULL,
    event_type text NOT NULL,
    stream_key text,
    envelope json NOT NULL,
    status text DEFAULT 'pending' NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    available_at timestamp with time zone DEFAULT now() NOT NULL,
    locked_by text,
    locked_until timestamp with time zone,
    last_error text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    published_at timestamp with time zone,
    xid xid8 DEFAULT pg_current_xact_id() NOT NULL,
    lease_token bigint,
    last_attempt_at timestamp with time zone,
    receipt text,
    first_attempt_at timestamp with time zone,
    CONSTRAINT ck_router_outbox_status CHECK (status IN ('pending', 'processing', 'published',
                                                         'failed', 'abandoned'))
"""

SLOTS = 8

# 0008's autovacuum settings, per partition: a partitioned table itself has no storage.
STORAGE = (
    "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000, "
    "autovacuum_vacuum_cost_delay = 0, autovacuum_analyze_scale_factor = 0.02"
)

PARTITIONED = [
    f"CREATE TABLE router_outbox ({COLUMN_DEFINITIONS})"
    " PARTITION BY LIST ((status IN ('published', 'abandoned')))",
    "CREATE TABLE router_outbox_done PARTITION OF router_outbox FOR VALUES IN (true)"
    f" WITH ({STORAGE})",
    "CREATE TABLE router_outbox_queue PARTITION OF router_outbox FOR VALUES IN (false)"
    " PARTITION BY LIST (((seq >> 15) & 7))",
    *(
        f"CREATE TABLE router_outbox_q{slot} PARTITION OF router_outbox_queue"
        f" FOR VALUES IN ({slot}) WITH ({STORAGE})"
        for slot in range(SLOTS)
    ),
    # 0008: no statistics on target and status (the planner must not trust them).
    "ALTER TABLE router_outbox ALTER COLUMN target SET STATISTICS 0",
    "ALTER TABLE router_outbox ALTER COLUMN status SET STATISTICS 0",
    # The queue: seq (the mark's, and the primary key's), and the claim's three indexes, one
    # per slot (named after the slot, so plans say which slot they read), the claim's
    # gathered under the parent's index.
    *(
        statement
        for slot in range(SLOTS)
        for statement in (
            f"CREATE UNIQUE INDEX ix_router_outbox_seq_q{slot} ON router_outbox_q{slot} (seq)",
            f"CREATE INDEX ix_router_outbox_claim_q{slot} ON router_outbox_q{slot} (target, seq)"
            " WHERE status IN ('pending', 'failed')",
            f"CREATE INDEX ix_router_outbox_stream_q{slot} ON router_outbox_q{slot}"
            " (target, stream_key, seq) WHERE status IN ('processing', 'failed')",
            f"CREATE INDEX ix_router_outbox_due_q{slot} ON router_outbox_q{slot}"
            " (target, available_at) WHERE status = 'failed'",
        )
    ),
    "CREATE INDEX ix_router_outbox_claim ON router_outbox_queue (target, seq)"
    " WHERE status IN ('pending', 'failed')",
    "CREATE INDEX ix_router_outbox_stream ON router_outbox_queue (target, stream_key, seq)"
    " WHERE status IN ('processing', 'failed')",
    "CREATE INDEX ix_router_outbox_due ON router_outbox_queue (target, available_at)"
    " WHERE status = 'failed'",
    # The history: what the primary key and the unique message did, and retention's indexes.
    "CREATE UNIQUE INDEX ix_router_outbox_done_seq ON router_outbox_done (seq)",
    "CREATE UNIQUE INDEX uq_router_outbox_message_target ON router_outbox_done"
    " (message_id, target)",
    "CREATE INDEX ix_router_outbox_published ON router_outbox_done (published_at)"
    " WHERE status = 'published'",
    "CREATE INDEX ix_router_outbox_abandoned ON router_outbox_done (last_attempt_at)"
    " WHERE status = 'abandoned'",
    # The claims' gate (see router_claim()): one row.
    "CREATE TABLE router_ring (id boolean PRIMARY KEY DEFAULT true CHECK (id),"
    " gate_until timestamp with time zone)",
    "INSERT INTO router_ring (id) VALUES (true)",
]

# 0010's table, for the downgrade.
FLAT = [
    f"CREATE TABLE router_outbox ({COLUMN_DEFINITIONS}) WITH ({STORAGE})",
    "ALTER TABLE router_outbox ALTER COLUMN target SET STATISTICS 0",
    "ALTER TABLE router_outbox ALTER COLUMN status SET STATISTICS 0",
    "ALTER TABLE router_outbox ADD CONSTRAINT router_outbox_pkey PRIMARY KEY (seq)",
    "CREATE UNIQUE INDEX uq_router_outbox_message_target ON router_outbox (message_id, target)",
    "CREATE INDEX ix_router_outbox_claim ON router_outbox (target, seq)"
    " WHERE status IN ('pending', 'failed')",
    "CREATE INDEX ix_router_outbox_stream ON router_outbox (target, stream_key, seq)"
    " WHERE status IN ('processing', 'failed')",
    "CREATE INDEX ix_router_outbox_due ON router_outbox (target, available_at)"
    " WHERE status = 'failed'",
    "CREATE INDEX ix_router_outbox_published ON router_outbox (published_at)"
    " WHERE status = 'published'",
    "CREATE INDEX ix_router_outbox_abandoned ON router_outbox (last_attempt_at)"
    " WHERE status = 'abandoned'",
]

# Index names are the schema's, not the table's: the old table's must be free first.
FREE_NAMES = [
    f"DROP INDEX {name}"
    for name in (
        "ix_router_outbox_claim",
        "ix_router_outbox_stream",
        "ix_router_outbox_due",
        "ix_router_outbox_published",
        "ix_router_outbox_abandoned",
        "uq_router_outbox_message_target",
    )
]


def _rebuild(statements: list[str]) -> None:
    """Replace router_outbox with the table ``statements`` make, rows and sequence kept."""
    op.execute("LOCK TABLE router_outbox IN ACCESS EXCLUSIVE MODE")
    op.execute(
        "CREATE TEMPORARY TABLE router_outbox_next_seq AS "
        "SELECT last_value, is_called FROM router_outbox_seq_seq"
    )
    op.execute("ALTER TABLE router_outbox RENAME TO router_outbox_old")
    op.execute("ALTER TABLE router_outbox_old ALTER COLUMN seq DROP IDENTITY")
    for statement in FREE_NAMES:
        op.execute(statement)
    for statement in statements:
        op.execute(statement)
    op.execute(f"INSERT INTO router_outbox ({COLUMNS}) SELECT {COLUMNS} FROM router_outbox_old")
    op.execute(
        "SELECT setval('router_outbox_seq_seq', last_value, is_called) FROM router_outbox_next_seq"
    )
    op.execute("DROP TABLE router_outbox_old, router_outbox_next_seq")
    op.execute("ANALYZE router_outbox")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    _rebuild(PARTITIONED)
    op.execute(CLAIM_FUNCTION)
    op.execute(MARK_FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    previous = earlier("0010_one_write_per_row.py")
    op.execute("DROP TABLE router_ring")
    _rebuild(FLAT)
    op.execute(previous.CLAIM_FUNCTION)
    op.execute(previous.MARK_FUNCTION)
