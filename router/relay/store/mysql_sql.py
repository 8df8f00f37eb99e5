"""The MySQL and MariaDB claim and mark, statement by statement, with why each is there.

MySQL has no ``UPDATE ... RETURNING`` and takes ``SKIP LOCKED`` only on a ``SELECT``, so the
claim that PostgreSQL runs as one function (``router.relay.store.postgres_sql``) is four
statements in one transaction here, run by ``router.relay.store.mysql.MysqlStore``:

1. ``LOCK_TARGET``: the target's row in ``router_targets``, ``FOR UPDATE``. Claims of one target
   take turns on it, as PostgreSQL's take turns on an advisory lock, and it says whether the
   target is paused, whether it has any gap marker, and whether it has a parked row.
   (``ENSURE_TARGET`` first makes the row, the first time.) With a parked row,
   ``PARKED_BEHIND`` and ``PARK`` park the rows staged behind one since, among the first the
   claim would look at (rows of a parked stream are parked as they come).
2. ``CANDIDATES``: a plain read of the due rows, streams in order. The store's sessions run
   in READ COMMITTED, so this statement sees every claim committed before the lock was
   granted: a row is never picked while an earlier row of its stream is in flight under a
   claim that committed a moment ago.
3. ``LOCK_ROWS``: the candidates again by primary key, ``FOR UPDATE SKIP LOCKED``, each still
   open and due: any number of processors never hold the same row, nor wait on each other.
4. On a target with ``atomic``: ``UNITS``, each row's unit, and while the claim holds part of
   one, ``CANDIDATES_AFTER`` and ``LOCK_ROWS`` again past its last row
   (``router.relay.store.units``).
5. ``LEASE``: the lease, fenced by the claim's token.
6. ``gaps_of``, only when step 1 found the target has gaps and some leased row has a stream
   key: the gaps before those rows (docs/guarantees.md). A target without gaps pays no
   statement more.

Before all this the store runs ``CANDIDATES`` once on its own, outside any transaction: when it
finds nothing (an idle target, the fallback poll), the claim ends there, one statement.
Marks, releases and the rest are single statements, each committing on its own.

Times come from the server's clock (``UTC_TIMESTAMP(6)``, the columns are UTC ``DATETIME(6)``).

Every statement names its index. The retention indexes lead with ``status``, and with few rows
in flight the optimizer takes them for ``status = 'processing'``: it then reads (and in an
UPDATE locks its way through) every in-flight row of every target, rather than the few rows
the statement names by key, and two marks of different targets could wait on each other.
"""

from __future__ import annotations

from router._schema import (
    GAPS,
    IX_OUTBOX_CLAIM,
    IX_OUTBOX_DUE,
    IX_OUTBOX_PUBLISHED,
    IX_OUTBOX_STREAM,
    IX_OUTBOX_UNIT,
    OUTBOX,
    TARGETS,
)
from router.relay.store.base import OPEN_STATUSES_SQL as _OPEN

__all__ = [
    "CANDIDATES",
    "CANDIDATES_AFTER",
    "CHECK_SCHEMA",
    "ENSURE_TARGET",
    "EXTEND",
    "LEASE",
    "LOCK_ROWS",
    "LOCK_TARGET",
    "MARK_ABANDONED",
    "MARK_FAILED",
    "MARK_KEPT",
    "MARK_PUBLISHED",
    "MARK_PUBLISHED_RECEIPTS",
    "NEXT_DUE",
    "PARK",
    "PARKED_BEHIND",
    "PARK_FOLLOWERS",
    "PAUSED",
    "RECORD_CIRCUIT",
    "RECORD_GAPS",
    "RELEASE",
    "SESSION",
    "UNITS",
    "WATCH",
    "close_gaps",
    "gaps_of",
    "in_list",
    "when_seq",
]

SESSION = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"
"""Every store connection's first statement. READ COMMITTED gives each statement a fresh
snapshot (step 2 above relies on it) and takes no gap locks, so a claim never makes an
application's INSERT wait (in REPEATABLE READ its scans would lock the gap new rows go in)."""

# The EXISTS are uncorrelated (MySQL runs each once) and, in READ COMMITTED, consistent
# reads: the rows they see are not locked. Whether a row is parked is one dive into the claim
# index (target, status). Parameters: the target, three times.
LOCK_TARGET = f"""
SELECT paused, EXISTS (SELECT 1 FROM {GAPS} g WHERE g.target = %s),
    EXISTS (SELECT 1 FROM {OUTBOX} s FORCE INDEX ({IX_OUTBOX_CLAIM})
            WHERE s.target = %s AND s.status = 'parked')
FROM {TARGETS} WHERE target = %s FOR UPDATE
"""

# A target whose circuit never changed and that was never paused has no row yet. Repeating
# the key makes the upsert take the row's lock without changing it.
ENSURE_TARGET = f"""
INSERT INTO {TARGETS} (target) VALUES (%s)
ON DUPLICATE KEY UPDATE target = target
"""


# The predecessor check of the PostgreSQL claim: a row waits while an earlier row of its
# stream is in flight under a live lease or waiting to retry. One NOT EXISTS per status, so
# each reads ix_router_outbox_stream by (target, stream_key, status) and only that stream's
# rows of that status, never its published history.
def _none_earlier(status: str, due_column: str) -> str:
    return f"""NOT EXISTS (
             SELECT 1 FROM {OUTBOX} p FORCE INDEX ({IX_OUTBOX_STREAM})
             WHERE p.target = o.target AND p.stream_key = o.stream_key
               AND p.status = '{status}' AND p.seq < o.seq
               AND p.{due_column} > UTC_TIMESTAMP(6))"""


# A held or parked row (migration 0017) holds its stream back for good, until an operator
# releases it. Whether the target has one at all is asked once per statement (uncorrelated:
# its own parameter, the target), so that a target without one, nearly always, pays no
# probe per candidate for it; the answer and the check are one statement's reads, of one
# snapshot, so a row held meanwhile cannot slip between them.
_NONE_SET_ASIDE = f"""(NOT EXISTS (
                 SELECT 1 FROM {OUTBOX} s FORCE INDEX ({IX_OUTBOX_CLAIM})
                 WHERE s.target = %s AND s.status IN ('held', 'parked'))
                OR NOT EXISTS (
                 SELECT 1 FROM {OUTBOX} p FORCE INDEX ({IX_OUTBOX_STREAM})
                 WHERE p.target = o.target AND p.stream_key = o.stream_key
                   AND p.status IN ('held', 'parked') AND p.seq < o.seq))"""

_IN_ORDER = f"""\
       AND (o.stream_key IS NULL
            OR {_none_earlier("processing", "locked_until")}
               AND {_none_earlier("failed", "available_at")}
               AND {_NONE_SET_ASIDE})"""


def _due(status: str, due_column: str | None, indexes: str, after: str) -> str:
    # One status at a time, each in ix_router_outbox_claim's order (target, status, seq): with
    # no partial index, this is how a claim skips the published history instead of walking it.
    # ``due_column`` None: due whatever its time (pending rows, see _candidates).
    due = "" if due_column is None else f" AND o.{due_column} <= UTC_TIMESTAMP(6)"
    return f"""
    (SELECT o.seq, o.stream_key FROM {OUTBOX} o {indexes}
     WHERE o.target = %s AND o.status = '{status}'{due}{after}
{_IN_ORDER}
     ORDER BY o.seq LIMIT %s)"""


_CLAIM_ORDER = f"FORCE INDEX ({IX_OUTBOX_CLAIM})"
# Failed rows: in outbox order, or the due ones by due time and then sorted (few are due at
# once, however many wait): whichever the statistics make cheaper.
_FAILED = f"USE INDEX ({IX_OUTBOX_CLAIM}, {IX_OUTBOX_DUE})"


# A pending row is due whatever its time, as on PostgreSQL (migration 0021): only a failed
# row waits for one, and it holds its stream back meanwhile. A pending row stamped later than
# this statement's clock (a requeue's UTC_TIMESTAMP(6), taken at its own statement's start)
# held nothing back, so the rows behind it on its stream went first.
def _candidates(after: str = "") -> str:
    return f"""
SELECT c.seq, c.stream_key FROM ({_due("pending", None, _CLAIM_ORDER, after)}
    UNION ALL {_due("failed", "available_at", _FAILED, after)}
    UNION ALL {_due("processing", "locked_until", _CLAIM_ORDER, after)}
) AS c
ORDER BY c.seq
LIMIT %s
"""


# The first `limit` due rows of each open status, then the first `limit` of those: the rows
# the PostgreSQL claim would pick. Parameters: (target, target, limit) three times, then limit.
CANDIDATES = _candidates()

# The same after a seq: the rows an atomic target's claim takes on to complete the units it
# cut (``router.relay.store.units``), before it leases any, so that its own rows, still
# pending, hold no stream back. Parameters: (target, seq, target, limit) three times, then
# limit.
CANDIDATES_AFTER = _candidates(" AND o.seq > %s")

# Each claimed row's unit (its transaction's token, NULL for a row staged without one) and
# how many rows of the unit the target has open or set aside, in flight under another claim
# too (then the unit is not whole here): one dive into ix_router_outbox_unit (target, xid)
# per row; a unit's rows are few. Parameters: the seqs.
UNITS = f"""
SELECT m.seq, m.xid,
    (SELECT COUNT(*) FROM {OUTBOX} u FORCE INDEX ({IX_OUTBOX_UNIT})
     WHERE u.target = m.target AND u.xid = m.xid
       AND u.status IN ({_OPEN}, 'held', 'parked'))
FROM {OUTBOX} m FORCE INDEX (PRIMARY)
WHERE m.seq IN ({{seqs}})
"""


def in_list(count: int) -> str:
    """``%s, %s, ...``: ``count`` placeholders for ``IN (...)``."""
    return ", ".join(["%s"] * count)


# The rows staged on a parked stream since its head was parked, among the first `limit`
# queued rows of the target (those a claim would otherwise walk past): parked as they come,
# each claim doing at most a batch of this work. Read first, then parked by key (``PARK``):
# MySQL updates no table that a subquery of the same statement reads. Parameters: (target,
# limit) twice, the limit, the target.
PARKED_BEHIND = f"""
SELECT w.seq FROM (
    (SELECT o.seq, o.stream_key FROM {OUTBOX} o {_CLAIM_ORDER}
     WHERE o.target = %s AND o.status = 'pending' ORDER BY o.seq LIMIT %s)
    UNION ALL
    (SELECT o.seq, o.stream_key FROM {OUTBOX} o {_CLAIM_ORDER}
     WHERE o.target = %s AND o.status = 'failed' ORDER BY o.seq LIMIT %s)
    ORDER BY seq LIMIT %s
) AS w
WHERE w.stream_key IS NOT NULL AND EXISTS (
    SELECT 1 FROM {OUTBOX} p FORCE INDEX ({IX_OUTBOX_STREAM})
    WHERE p.target = %s AND p.stream_key = w.stream_key AND p.status = 'parked'
      AND p.seq < w.seq)
"""

# Parked, if still queued (``PARKED_BEHIND``'s rows; a release may have come between).
# Parameters: the seqs.
PARK = f"""
UPDATE {OUTBOX} FORCE INDEX (PRIMARY) SET status = 'parked'
WHERE seq IN ({{seqs}}) AND status IN ('pending', 'failed')
"""

# Still open and due once locked (a late mark may have changed a row since step 2); the rows
# another transaction holds are skipped, not waited for. Parameters: target, then the seqs.
LOCK_ROWS = f"""
SELECT seq, message_id, destination, envelope, attempts, stream_key, created_at
FROM {OUTBOX} FORCE INDEX (PRIMARY)
WHERE target = %s AND seq IN ({{seqs}})
  AND status IN ({_OPEN})
  AND (status = 'pending'
       OR CASE WHEN status = 'processing' THEN locked_until ELSE available_at END
          <= UTC_TIMESTAMP(6))
ORDER BY seq
FOR UPDATE SKIP LOCKED
"""

# attempts counts this attempt; last_attempt_at feeds the retry rate and abandoned-row
# retention; first_attempt_at is for `router trace`. Parameters: worker, token, lease in
# microseconds, then the seqs.
LEASE = f"""
UPDATE {OUTBOX} FORCE INDEX (PRIMARY)
SET status = 'processing', locked_by = %s, lease_token = %s,
    locked_until = UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND,
    attempts = attempts + 1, last_attempt_at = UTC_TIMESTAMP(6),
    first_attempt_at = coalesce(first_attempt_at, UTC_TIMESTAMP(6))
WHERE seq IN ({{seqs}})
"""

# Every mark is fenced by the claim's token and 'processing': a worker that lost its lease
# (paused, partitioned, expired) cannot mark rows another claim now holds.
_HELD = "{row}lease_token = %s AND {row}status = 'processing'"

MARK_PUBLISHED = f"""
UPDATE {OUTBOX} FORCE INDEX (PRIMARY)
SET status = 'published', published_at = UTC_TIMESTAMP(6), last_error = NULL,
    locked_by = NULL, locked_until = NULL
WHERE seq IN ({{seqs}}) AND {_HELD.format(row="")}
"""

# Published rows with the broker's receipts, as CASE seq WHEN ... (``when_seq``). Parameters:
# the receipts' list, the seqs, the token.
MARK_PUBLISHED_RECEIPTS = f"""
UPDATE {OUTBOX} FORCE INDEX (PRIMARY)
SET status = 'published', published_at = UTC_TIMESTAMP(6), last_error = NULL,
    locked_by = NULL, locked_until = NULL, receipt = CASE seq {{receipts}} END
WHERE seq IN ({{seqs}}) AND {_HELD.format(row="")}
"""

# Each failed row with its own delay (in microseconds) and error, in one statement: the
# values come as CASE seq WHEN ... lists (``when_seq``). Parameters: the delays' list, the
# errors' list, the seqs, the token.
MARK_FAILED = f"""
UPDATE {OUTBOX} FORCE INDEX (PRIMARY)
SET status = 'failed',
    available_at = UTC_TIMESTAMP(6) + INTERVAL (CASE seq {{delays}} END) MICROSECOND,
    last_error = CASE seq {{errors}} END, locked_by = NULL, locked_until = NULL
WHERE seq IN ({{seqs}}) AND {_HELD.format(row="")}
"""

# No longer open, so never claimed again. Parameters: the errors' list, the seqs, the token.
MARK_ABANDONED = f"""
UPDATE {OUTBOX} FORCE INDEX (PRIMARY)
SET status = 'abandoned', last_error = CASE seq {{errors}} END,
    locked_by = NULL, locked_until = NULL
WHERE seq IN ({{seqs}}) AND {_HELD.format(row="")}
"""


# A stream's head given up on, on a target whose ordering keeps it: held, or parked. It keeps
# its error and its stream waits for an operator. Parameters: the status, the error, the seq,
# the token.
MARK_KEPT = f"""
UPDATE {OUTBOX} FORCE INDEX (PRIMARY)
SET status = %s, last_error = %s, locked_by = NULL, locked_until = NULL
WHERE seq = %s AND {_HELD.format(row="")}
"""

# The later queued rows of a parked head's stream on its target, parked with it in the mark's
# transaction (once MARK_KEPT parked the head under the mark's token, and after the batch's
# untried rows were given back: those of the stream are parked too). Parameters: the target,
# the stream key, the head's seq.
PARK_FOLLOWERS = f"""
UPDATE {OUTBOX} FORCE INDEX ({IX_OUTBOX_STREAM}) SET status = 'parked'
WHERE target = %s AND stream_key = %s AND status IN ('pending', 'failed') AND seq > %s
"""


# An abandoned row with a stream key leaves a gap in its stream, recorded in the mark's
# transaction (``MysqlStore.mark`` runs in one when a row is abandoned): the rows this mark
# abandoned, still under its token. A gap already recorded stays as it is. Parameters: the
# seqs, the token.
RECORD_GAPS = f"""
INSERT INTO {GAPS} (target, stream_key, seq, message_id)
SELECT o.target, o.stream_key, o.seq, o.message_id FROM {OUTBOX} o FORCE INDEX (PRIMARY)
WHERE o.seq IN ({{seqs}}) AND o.lease_token = %s AND o.status = 'abandoned'
  AND o.stream_key IS NOT NULL
ON DUPLICATE KEY UPDATE {GAPS}.seq = {GAPS}.seq
"""


def gaps_of(keys: int) -> str:
    """The gaps of ``keys`` streams of a target, ``(stream key, seq, message id)`` in seq
    order, read through the primary key. Parameters: the target, then the keys."""
    return f"""
SELECT stream_key, seq, message_id FROM {GAPS} FORCE INDEX (PRIMARY)
WHERE target = %s AND stream_key IN ({in_list(keys)})
ORDER BY seq
"""


def close_gaps(keys: int, ids: int) -> str:
    """DELETE the gaps that published rows named. A message id is one row's of the target;
    the keys lead the primary key to it. Parameters: the target, the keys, the ids."""
    return f"""
DELETE FROM {GAPS}
WHERE target = %s AND stream_key IN ({in_list(keys)}) AND message_id IN ({in_list(ids)})
"""


def when_seq(count: int) -> str:
    """``WHEN %s THEN %s ...``: one (seq, value) pair per row, for ``CASE seq ... END``."""
    return " ".join(["WHEN %s THEN %s"] * count)


# Claimed but not sent: back to what it was before the claim, and the attempt does not count.
# available_at stays: the row was due when claimed, so it is due now, and a row put back
# with its old time is no news to the watcher (WATCH), which a requeue's new time is.
RELEASE = f"""
UPDATE {OUTBOX} FORCE INDEX (PRIMARY)
SET status = CASE WHEN attempts > 1 THEN 'failed' ELSE 'pending' END,
    attempts = attempts - 1, locked_by = NULL, locked_until = NULL
WHERE seq IN ({{seqs}}) AND {_HELD.format(row="")}
"""

# The heartbeat of a batch still being published: its rows' lease, fenced by the claim's token
# alone (rows another claim took over carry its token) and 'processing' (a marked row is
# done); ix_router_outbox_claim reads the target's in-flight rows and no others. MySQL counts
# the rows changed, not those found, which here is every row held: the processor never
# extends by less than the claim's own lease, so each new end is later than the old one, to
# the microsecond. Parameters: the lease in microseconds, the target, the token.
EXTEND = f"""
UPDATE {OUTBOX} FORCE INDEX ({IX_OUTBOX_CLAIM})
SET locked_until = UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND
WHERE target = %s AND status = 'processing' AND lease_token = %s
"""

PAUSED = f"SELECT paused FROM {TARGETS} WHERE target = %s"

# The earliest retry and lease end, each one index lookup in ix_router_outbox_due (a MIN
# over an IN list would read every open row); the store takes the smaller. Not pending rows:
# the claim before took every one it could (see the PostgreSQL store).
NEXT_DUE = f"""
SELECT UTC_TIMESTAMP(6),
    (SELECT MIN(available_at) FROM {OUTBOX} FORCE INDEX ({IX_OUTBOX_DUE})
     WHERE target = %s AND status = 'failed'),
    (SELECT MIN(locked_until) FROM {OUTBOX} FORCE INDEX ({IX_OUTBOX_DUE})
     WHERE target = %s AND status = 'processing')
"""

# The new values are given twice rather than through VALUES(), which MySQL 8.0.20 deprecated
# and whose replacement (a row alias) MariaDB does not have.
RECORD_CIRCUIT = f"""
INSERT INTO {TARGETS} (target, circuit, circuit_since, circuit_worker, circuit_error)
VALUES (%s, %s, UTC_TIMESTAMP(6), %s, %s)
ON DUPLICATE KEY UPDATE circuit = %s, circuit_since = UTC_TIMESTAMP(6),
    circuit_worker = %s, circuit_error = %s
"""

CHECK_SCHEMA = """
SELECT COUNT(*) FROM information_schema.TABLES
WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s
"""

# What the watcher polls, as one row:
# - the newest committed row, read from the end of the primary key: new rows;
# - the newest available_at of a pending row, per target one dive into ix_router_outbox_due
#   (a loose index scan: EXPLAIN says "Using index for group-by"), then the latest of those.
#   Only a rise counts: a claim takes pending rows away and a release puts them back with
#   the time they had, but a requeue stamps its rows with UTC_TIMESTAMP(6), later than any;
# - per target, the lowest and highest seq of its pending rows (a loose index scan of
#   ix_router_outbox_claim): a transaction that drew its seq before others committed, and
#   commits after they were seen, changes neither of the first two but moves one of these,
#   unless its row falls between two pending rows of its target that no claim took;
# - the paused targets: how many, and the newest pause. A resume lowers the count unless a
#   target was paused since, which moves the newest pause (stamped by the server too).
# One statement either way; the watcher wakes the processors when any but the second
# changes, or the second rises.
WATCH = f"""
SELECT (SELECT MAX(seq) FROM {OUTBOX}),
    (SELECT MAX(newest) FROM (
        SELECT MAX(available_at) AS newest FROM {OUTBOX} FORCE INDEX ({IX_OUTBOX_DUE})
        WHERE status = 'pending' GROUP BY target) AS pending),
    (SELECT GROUP_CONCAT(target, ' ', lo, ' ', hi ORDER BY target) FROM (
        SELECT target, MIN(seq) AS lo, MAX(seq) AS hi FROM {OUTBOX}
        FORCE INDEX ({IX_OUTBOX_CLAIM}) WHERE status = 'pending' GROUP BY target) AS queued),
    (SELECT COUNT(*) FROM {TARGETS} WHERE paused),
    (SELECT MAX(paused_at) FROM {TARGETS} WHERE paused)
"""

# A dead worker's leases, fenced by its id (see the PostgreSQL store), back as RELEASE puts
# rows back. ix_router_outbox_published leads with status: it reads the in-flight rows of
# every target and nothing else. Parameter: the worker id.
RELEASE_WORKER = f"""
UPDATE {OUTBOX} FORCE INDEX ({IX_OUTBOX_PUBLISHED})
SET status = CASE WHEN attempts > 1 THEN 'failed' ELSE 'pending' END,
    attempts = attempts - 1, available_at = UTC_TIMESTAMP(6), locked_by = NULL,
    locked_until = NULL
WHERE status = 'processing' AND locked_by = %s
"""
