"""The outbox on SQLite (the embedded default), through aiosqlite.

SQLite has one writer at a time, so a claim is a single ``BEGIN IMMEDIATE`` transaction: it
takes the write lock first and then picks and leases rows, which makes concurrent routers on
one file safe. Times are UTC text (``router._db.sqlite_time``) computed here, not by SQLite.
SQLite has no NOTIFY: ``watch`` notices commits by the database file's WAL changing, which
costs a ``stat`` call per interval and no SQL at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiosqlite

from envelopes import DatabaseError
from router._db import SQLITE_BUSY_TIMEOUT, sqlite_time
from router._schema import GAPS, OUTBOX, TARGETS
from router.relay.pumps import Overlapping
from router.relay.store.base import (
    OPEN_STATUSES_SQL,
    VERSION_TABLE,
    Claim,
    ClaimedRow,
    Marks,
    Wake,
    Wakeup,
    describe_error,
    name_gaps,
    new_token,
    schema_problem,
)
from router.relay.store.outage import Outage
from router.relay.store.units import complete_units

__all__ = ["SqliteStore"]

# The rows that hold their stream back: in flight, waiting to retry, or held or parked (for
# good, until an operator releases them: their time is FOR_GOOD, after any other). Word for
# word the predicate of ix_router_outbox_stream (migration 0017), which SQLite uses only for
# a statement that repeats it.
HOLDING_BACK = "('processing', 'failed', 'held', 'parked')"
FOR_GOOD = "9999-12-31"


def _claim(after: str = "", own: str = "") -> str:
    # SQLite has one writer at a time and the claim holds the write lock (BEGIN IMMEDIATE), so
    # the predecessor check below always sees every earlier claim. A pending row is due
    # whatever its time, as on PostgreSQL (migration 0021): the claim's time is taken before
    # it waits for the lock, so a row a release stamped meanwhile read as not yet due, held
    # nothing back, and the rows behind it on its stream went first.
    return f"""
UPDATE {OUTBOX}
SET status = 'processing', locked_by = ?, lease_token = ?, locked_until = ?,
    attempts = attempts + 1, last_attempt_at = ?, first_attempt_at = coalesce(first_attempt_at, ?)
WHERE NOT EXISTS (SELECT 1 FROM {TARGETS} t WHERE t.target = ? AND t.paused)
  AND seq IN (
    SELECT o.seq FROM {OUTBOX} o
    WHERE o.target = ?{after}
      AND o.status IN ({OPEN_STATUSES_SQL})
      AND (o.status = 'pending'
           OR CASE WHEN o.status = 'processing' THEN o.locked_until ELSE o.available_at END <= ?)
      AND (o.stream_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {OUTBOX} p
            WHERE p.target = o.target AND p.stream_key = o.stream_key AND p.seq < o.seq
              AND p.status IN {HOLDING_BACK}{own}
              AND CASE WHEN p.status = 'processing' THEN p.locked_until
                       WHEN p.status = 'failed' THEN p.available_at
                       ELSE '{FOR_GOOD}' END > ?))
    ORDER BY o.target, o.seq
    LIMIT ?
)
RETURNING seq, message_id, destination, envelope, attempts, stream_key, created_at,
    EXISTS (SELECT 1 FROM {GAPS} g WHERE g.target = ?)
"""


CLAIM = _claim()
# The same after a seq, for an atomic target's claim that completes the units it cut
# (``router.relay.store.units``): its own rows, leased a moment ago (its token), hold no later
# row of their streams back. Parameters: CLAIM's, with the seq after the second target and
# the token before the second stamp.
CLAIM_AFTER = _claim(" AND o.seq > ?", " AND NOT (p.status = 'processing' AND p.lease_token = ?)")


# Each claimed row's unit (its transaction's token, NULL for a row staged without one) and
# how many rows of the unit the target has open or set aside, in flight under another claim
# too (then the unit is not whole here): ix_router_outbox_unit (target, xid), partial on
# ``xid IS NOT NULL``, which the equality implies. Parameters: the seqs.
def units_of(count: int) -> str:
    """``UNITS`` for ``count`` seqs."""
    return f"""
SELECT m.seq, m.xid,
    (SELECT count(*) FROM {OUTBOX} u
     WHERE u.target = m.target AND u.xid = m.xid
       AND u.status IN ({OPEN_STATUSES_SQL}, 'held', 'parked'))
FROM {OUTBOX} m
WHERE m.seq IN ({", ".join(["?"] * count)})
"""


# The last column: whether the target has any gap marker (docs/guarantees.md). Uncorrelated,
# so SQLite runs it once per claim (one probe of router_gaps' primary key), not per row; only
# when it says yes are the claimed streams' gaps read (GAPS), in the claim's transaction.


# Rows staged on a parked stream after its head was parked are parked as they come: the claim
# first parks those among the first `limit` queued rows of the target (those it would
# otherwise walk past), so each claim does at most a batch of this work. Whether the target
# has a parked row at all decides the window's LIMIT, which SQLite works out once, before it
# reads any queued row: a target without one (nearly always) pays that one probe of the stream
# index. (As a term of a WHERE it came after the window was read: 0.25 ms a claim, or 1.8 ms,
# for nothing, on 50,000 queued rows.) Parameters: the target twice, the limit, the target.
PARK_BEHIND = f"""
UPDATE {OUTBOX} SET status = 'parked'
WHERE seq IN (
    SELECT w.seq FROM (
        SELECT c.seq, c.stream_key FROM {OUTBOX} c
        WHERE c.target = ? AND c.status IN ({OPEN_STATUSES_SQL}) AND c.status <> 'processing'
        ORDER BY c.target, c.seq
        LIMIT CASE WHEN EXISTS (
            SELECT 1 FROM {OUTBOX} g
            WHERE g.target = ? AND g.stream_key IS NOT NULL
              AND g.status IN {HOLDING_BACK} AND g.status = 'parked') THEN ? ELSE 0 END) w
    WHERE w.stream_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM {OUTBOX} p
        WHERE p.target = ? AND p.stream_key = w.stream_key AND p.seq < w.seq
          AND p.status IN {HOLDING_BACK} AND p.status = 'parked'))
"""


def gaps_of(keys: int) -> str:
    """The gaps of ``keys`` streams of a target, ``(stream key, seq, message id)`` in seq
    order; parameters: the target, then the keys."""
    return f"""
SELECT stream_key, seq, message_id FROM {GAPS}
WHERE target = ? AND stream_key IN ({", ".join(["?"] * keys)})
ORDER BY seq
"""


# An abandoned row with a stream key leaves a gap in its stream, recorded in the mark's
# transaction; only if this mark abandoned it (its token, and abandoned now).
RECORD_GAP = f"""
INSERT INTO {GAPS} (target, stream_key, seq, message_id, abandoned_at)
SELECT target, stream_key, seq, message_id, ? FROM {OUTBOX}
WHERE seq = ? AND lease_token = ? AND status = 'abandoned' AND stream_key IS NOT NULL
ON CONFLICT DO NOTHING
"""


def close_gaps(keys: int, ids: int) -> str:
    """DELETE the gaps published rows named: parameters: the target, the keys, the ids (a
    message id is one row's of the target; the keys lead the primary key to it)."""
    return f"""
DELETE FROM {GAPS}
WHERE target = ? AND stream_key IN ({", ".join(["?"] * keys)})
  AND message_id IN ({", ".join(["?"] * ids)})
"""


RECORD_CIRCUIT = f"""
INSERT INTO {TARGETS} (target, paused, circuit, circuit_since, circuit_worker, circuit_error)
VALUES (?, 0, ?, ?, ?, ?)
ON CONFLICT (target) DO UPDATE
SET circuit = excluded.circuit, circuit_since = excluded.circuit_since,
    circuit_worker = excluded.circuit_worker, circuit_error = excluded.circuit_error
"""

MARK_PUBLISHED = f"""
UPDATE {OUTBOX}
SET status = 'published', published_at = ?, last_error = NULL, locked_by = NULL,
    locked_until = NULL, receipt = ?
WHERE seq = ? AND lease_token = ? AND status = 'processing'
"""

MARK_FAILED = f"""
UPDATE {OUTBOX}
SET status = 'failed', available_at = ?, last_error = ?, locked_by = NULL, locked_until = NULL
WHERE seq = ? AND lease_token = ? AND status = 'processing'
"""

MARK_ABANDONED = f"""
UPDATE {OUTBOX}
SET status = 'abandoned', last_error = ?, locked_by = NULL, locked_until = NULL
WHERE seq = ? AND lease_token = ? AND status = 'processing'
"""

# A stream's head given up on, on a target whose ordering keeps it (held or parked): its
# stream waits for an operator. Parameters: the status, the error, the seq, the token.
MARK_KEPT = f"""
UPDATE {OUTBOX}
SET status = ?, last_error = ?, locked_by = NULL, locked_until = NULL
WHERE seq = ? AND lease_token = ? AND status = 'processing'
"""

# A parked head's stream: every later queued row of it on the target is parked with it, in
# the mark's transaction, if this mark parked the head (its token). After the batch's untried
# rows are given back, so that those of the stream are parked too. Parameters: the target, the
# seq, the token, the seq again.
PARK_FOLLOWERS = f"""
UPDATE {OUTBOX} SET status = 'parked'
WHERE target = ? AND status IN ({OPEN_STATUSES_SQL}) AND status <> 'processing'
  AND stream_key = (SELECT h.stream_key FROM {OUTBOX} h
                    WHERE h.seq = ? AND h.lease_token = ? AND h.status = 'parked')
  AND seq > ?
"""

RELEASE = f"""
UPDATE {OUTBOX}
SET status = CASE WHEN attempts > 1 THEN 'failed' ELSE 'pending' END,
    attempts = attempts - 1, available_at = ?, locked_by = NULL, locked_until = NULL
WHERE seq = ? AND lease_token = ? AND status = 'processing'
"""

# A batch's heartbeat, fenced by its token and 'processing' (see the PostgreSQL store). SQLite
# uses a partial index only when the statement repeats its condition, hence the status list.
EXTEND = f"""
UPDATE {OUTBOX} SET locked_until = ?
WHERE target = ? AND status IN ({OPEN_STATUSES_SQL})
  AND lease_token = ? AND status = 'processing'
"""

# A dead worker's leases, fenced by its id (see the PostgreSQL store): as RELEASE does.
RELEASE_WORKER = f"""
UPDATE {OUTBOX}
SET status = CASE WHEN attempts > 1 THEN 'failed' ELSE 'pending' END,
    attempts = attempts - 1, available_at = ?, locked_by = NULL, locked_until = NULL
WHERE locked_by = ? AND status = 'processing'
"""

PAUSED = f"SELECT paused FROM {TARGETS} WHERE target = ?"

# Not pending rows: the claim before took every one it could (see the PostgreSQL store).
NEXT_DUE = f"""
SELECT min(CASE WHEN status = 'processing' THEN locked_until ELSE available_at END)
FROM {OUTBOX}
WHERE target = ? AND status IN ('failed', 'processing')
"""


def _rows(records: Sequence[Any]) -> list[ClaimedRow]:
    """The rows of a claim's records, in outbox order."""
    rows = [ClaimedRow(r[0], r[1], r[2], r[3], r[4], r[5], _epoch(r[6])) for r in records]
    rows.sort(key=lambda r: r.seq)
    return rows


class _NothingToSend(Exception):
    """An atomic claim took only parts of units (a member held, parked, or behind its
    stream): it is rolled back rather than committed and given back. Either would change the
    database's files, which wakes every processor of it (``watch``), this one included: it
    claimed those rows again about 20 times a second until the unit could go."""


class SqliteStore:
    """One aiosqlite connection shared by a database's processors, one transaction at a time."""

    kind = "sqlite"
    pump = Overlapping  # leases: claims overlap publishing

    def __init__(self, name: str, path: Path, *, watch_interval: float = 0.05) -> None:
        self.name = name
        self.outage = Outage(name)
        self.path = path
        self.watch_interval = watch_interval
        self.wakeup = Wakeup("log", f"its WAL file, looked at every {watch_interval * 1000:g} ms")
        self._db: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()

    async def claim(
        self,
        target: str,
        limit: int,
        worker: str,
        lease_seconds: float,
        after: Claim | None = None,  # leases: never given (its pump overlaps claims)
        *,
        units: bool = False,
    ) -> Claim:
        """Lease up to ``limit`` due rows of ``target``, oldest first, streams in order;
        ``units``: see ``OutboxStore.claim`` (``router.relay.store.units``)."""
        token = new_token()
        now = datetime.now(UTC)
        until = sqlite_time(now + timedelta(seconds=lease_seconds))
        stamp = sqlite_time(now)
        claimed = (worker, token, until, stamp, stamp, target, target)
        try:
            async with self._transaction() as db:
                parked = await db.execute(PARK_BEHIND, (target, target, limit, target))
                cursor = await db.execute(CLAIM, (*claimed, stamp, stamp, limit, target))
                records = list(await cursor.fetchall())
                rows = _rows(records)
                if units and rows:
                    await self._units(db, rows, (*claimed, stamp, token, stamp))
                    if not parked.rowcount and not any(row.whole for row in rows):
                        raise _NothingToSend
                keys = sorted({r.stream_key for r in rows if r.stream_key is not None})
                if keys and records[0][7]:  # the target has gaps: which are before these rows
                    cursor = await db.execute(gaps_of(len(keys)), (target, *keys))
                    name_gaps(rows, [(r[0], r[1], r[2]) for r in await cursor.fetchall()])
        except _NothingToSend:
            return Claim(token, [])
        return Claim(token, rows)

    async def _units(
        self, db: aiosqlite.Connection, rows: list[ClaimedRow], claimed: tuple[object, ...]
    ) -> None:
        """An atomic target's claim made whole (``complete_units``): ``claimed`` is
        ``CLAIM_AFTER``'s parameters before the seq (the first seven) and after it (the stamp,
        the token, the stamp); the limit and the target follow."""
        before, since, target = claimed[:7], claimed[7:], claimed[6]

        async def count(seqs: Sequence[int]) -> list[Any]:
            found = await db.execute(units_of(len(seqs)), tuple(seqs))
            return list(await found.fetchall())

        async def claim_on(after: int, limit: int) -> list[ClaimedRow]:
            found = await db.execute(CLAIM_AFTER, (*before, after, *since, limit, target))
            return _rows(list(await found.fetchall()))

        await complete_units(rows, count, claim_on)

    async def mark(self, target: str, token: int, marks: Marks) -> None:
        """Write back a batch's outcomes in one transaction."""
        now = datetime.now(UTC)
        stamp = sqlite_time(now)
        async with self._transaction() as db:
            if marks.published:
                receipts = marks.receipts
                await db.executemany(
                    MARK_PUBLISHED,
                    [(stamp, receipts.get(s), s, token) for s in marks.published],
                )
            if marks.failed:
                await db.executemany(
                    MARK_FAILED,
                    [
                        (sqlite_time(now + timedelta(seconds=delay)), error, seq, token)
                        for seq, delay, error in marks.failed
                    ],
                )
            if marks.abandoned:
                await db.executemany(
                    MARK_ABANDONED, [(error, seq, token) for seq, error in marks.abandoned]
                )
                await db.executemany(
                    RECORD_GAP, [(stamp, seq, token) for seq, _ in marks.abandoned]
                )
            kept = [("held", seq, error) for seq, error in marks.held]
            kept += [("parked", seq, error) for seq, _, error in marks.parked]
            if kept:
                await db.executemany(
                    MARK_KEPT, [(status, error, seq, token) for status, seq, error in kept]
                )
            if marks.reported:  # after the gaps above: a later row of the batch may name one
                keys = sorted({key for key, _ in marks.reported})
                ids = [message_id for _, message_id in marks.reported]
                await db.execute(close_gaps(len(keys), len(ids)), (target, *keys, *ids))
            if marks.untried:
                await db.executemany(RELEASE, [(stamp, seq, token) for seq in marks.untried])
            if marks.parked:
                await db.executemany(
                    PARK_FOLLOWERS, [(target, seq, token, seq) for seq, _, _ in marks.parked]
                )

    async def release(self, target: str, token: int, seqs: Sequence[int]) -> None:
        """Return untried rows to the queue without counting an attempt."""
        if seqs:
            stamp = sqlite_time(datetime.now(UTC))
            async with self._transaction() as db:
                await db.executemany(RELEASE, [(stamp, seq, token) for seq in seqs])

    async def extend(self, target: str, token: int, lease_seconds: float) -> int:
        """Hold the rows still under ``token`` until ``lease_seconds`` from now."""
        until = sqlite_time(datetime.now(UTC) + timedelta(seconds=lease_seconds))
        async with self._transaction() as db:
            cursor = await db.execute(EXTEND, (until, target, token))
            return cursor.rowcount

    async def next_due(self, target: str) -> float | None:
        """Seconds until the earliest open row of ``target`` is due."""
        row = await self._one(NEXT_DUE, (target,))
        if row is None or row[0] is None:
            return None
        due = datetime.strptime(row[0], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC)
        return max(0.0, (due - datetime.now(UTC)).total_seconds())

    async def paused(self, target: str) -> bool:
        """Whether the target is paused."""
        row = await self._one(PAUSED, (target,))
        return bool(row and row[0])

    async def _one(self, sql: str, parameters: tuple[Any, ...]) -> Any:
        """The first row of a read (None: no row)."""
        async with self._lock:
            db = await self._open()
            try:
                cursor = await db.execute(sql, parameters)
                return await cursor.fetchone()
            except aiosqlite.Error as exc:
                raise _database_error(self.name, exc) from exc

    async def record_circuit(self, target: str, state: str, worker: str, error: str | None) -> None:
        """Upsert the target's circuit state into router_targets."""
        stamp = sqlite_time(datetime.now(UTC))
        async with self._transaction() as db:
            await db.execute(RECORD_CIRCUIT, (target, state, stamp, worker, error))

    async def check_schema(self) -> None:
        """Check the file opens and its router tables are at this router's migration."""
        if not self.path.exists():
            raise schema_problem(self.name, None) or DatabaseError(self.name)
        async with self._lock:
            db = await self._open()
            cursor = await db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (VERSION_TABLE,)
            )
            revision = None
            if await cursor.fetchone() is not None:
                cursor = await db.execute(f"SELECT version_num FROM {VERSION_TABLE}")
                row = await cursor.fetchone()
                revision = row[0] if row else None
        problem = schema_problem(self.name, revision)
        if problem is not None:
            raise problem

    async def idle(self, target: str) -> float | None:
        """Nothing to do: the watcher wakes processors whatever they are doing."""
        return None

    def busy(self, target: str) -> None:
        """Nothing to do (see ``idle``)."""

    async def probe_wakeup(self) -> Wakeup:
        """Always the WAL file watcher, whatever ``wakeup`` says."""
        return self.wakeup

    async def watch(self, wake: Wake) -> None:
        """Wake the processors whenever the database or its WAL file changes."""
        wal = self.path.with_name(self.path.name + "-wal")
        seen = None
        while True:
            current = (_signature(self.path), _signature(wal))
            if current != seen:
                seen = current
                wake(None)
            await asyncio.sleep(self.watch_interval)

    async def close(self) -> None:
        """Close the connection."""
        db, self._db = self._db, None
        if db is not None:
            with contextlib.suppress(Exception):
                await db.close()

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        async with self._lock:
            db = await self._open()
            try:
                await db.execute("BEGIN IMMEDIATE")
            except aiosqlite.Error as exc:
                raise _database_error(self.name, exc) from exc
            try:
                yield db
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    await asyncio.shield(db.execute("ROLLBACK"))
                if isinstance(exc, aiosqlite.Error):
                    raise _database_error(self.name, exc) from exc
                raise
            else:
                try:
                    await db.execute("COMMIT")
                except aiosqlite.Error as exc:
                    raise _database_error(self.name, exc) from exc

    async def _open(self) -> aiosqlite.Connection:
        if self._db is not None:
            return self._db
        if not self.path.exists():
            raise DatabaseError(f"{self.name}: {self.path} does not exist; run 'router init-db'")
        try:
            db = await aiosqlite.connect(
                self.path, timeout=SQLITE_BUSY_TIMEOUT, isolation_level=None
            )
            await db.execute("PRAGMA journal_mode=WAL")
            # The router's own writes (claims, marks) may be lost on power failure without harm:
            # a lost mark means one more delivery, which at-least-once already allows.
            await db.execute("PRAGMA synchronous=NORMAL")
        except aiosqlite.Error as exc:
            raise _database_error(self.name, exc) from exc
        self._db = db
        return db

    async def release_worker(self, worker: str) -> int:
        """Give back every row a dead ``worker`` holds, in one UPDATE; the other processes'
        watchers see the file change and wake their processors."""
        stamp = sqlite_time(datetime.now(UTC))
        async with self._transaction() as db:
            cursor = await db.execute(RELEASE_WORKER, (stamp, worker))
            return cursor.rowcount


def _epoch(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        moment = datetime.strptime(stamp[:26], "%Y-%m-%d %H:%M:%S.%f")
    except ValueError:
        return None
    return moment.replace(tzinfo=UTC).timestamp()


def _signature(path: Path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size)


def _database_error(name: str, exc: BaseException) -> DatabaseError:
    text = str(exc)
    if "no such table" in text:
        return DatabaseError(f"{name}: no {OUTBOX} table; run 'router init-db'")
    return DatabaseError(f"{name}: {describe_error(exc)}")
