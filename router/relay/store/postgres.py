"""The outbox on PostgreSQL, through asyncpg (the processor's hot path skips SQLAlchemy).

A claim runs in a transaction that stays open while its batch is published: the rows'
``FOR UPDATE`` locks are its lease, and the batch's outcomes are written in the same
transaction before it commits, one write per row (migration 0010). Batches of one target take
turns across every worker and host (an advisory lock held to the commit), so streams stay in
order; a worker that dies takes its transaction with it and the rows are queued as they were.
The relay learns of new rows from the database's log where the server allows it
(``wakeup: log``, or ``auto``: router/relay/store/postgres_wal.py follows the outbox's inserts
through logical decoding), else from ``NOTIFY router_outbox``, whose payload names the targets
and is delivered only when the writer commits. A writer sends one only while a relay of its
target is idle and listening, which a processor shows by holding its wake lock on the LISTEN
connection (``postgres_wake.py``); a relay that follows the log holds none, so then no writer
notifies. With ``wakeup: poll`` (no LISTEN: behind a pooler in transaction mode, say) no writer
notifies either, and a watcher looks every ``WATCH_FAST`` seconds (``WATCH``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

import asyncpg

from envelopes import DatabaseError
from router._schema import FN_CLAIM, FN_MARK, OUTBOX_QUEUE, TARGETS
from router._wakeup import CHANNEL
from router.relay.pumps import TransactionRuns
from router.relay.store.base import (
    VERSION_TABLE,
    BatchLost,
    Claim,
    ClaimedRow,
    Marks,
    Wake,
    Wakeup,
    describe_error,
    new_token,
    schema_problem,
)
from router.relay.store.outage import Outage
from router.relay.store.postgres_errors import DB_ERRORS
from router.relay.store.postgres_upkeep import Upkeep
from router.relay.store.postgres_wake import WakeLocks
from router.relay.store.postgres_wal import Follower, LogLost, log_problem
from router.relay.store.units import complete_units

__all__ = ["CHANNEL", "PostgresStore"]

log = logging.getLogger(__name__)


# The LISTEN connection's longest pause between tries while the database is away. Its return
# wakes every processor of the database, whose own pauses grow to 30 s: so after an outage of
# any length (a failover: the replica promoted), delivery resumes within this of the server
# accepting writes again. One connection attempt per 2 s and worker costs nothing.
LISTEN_RETRY_MAX = 2.0

# The log follower's longest pause between tries. LISTEN covers the gap, so this only bounds
# how long writers' commits wake the relay the old way after the replication connection is
# back (or the DBA fixed what kept it out).
LOG_RETRY_MAX = 30.0

# The poll's pace (``wakeup: poll``): a look every 50 ms, one cheap statement (``WATCH``).
WATCH_FAST = 0.05

# What the poll compares from one look to the next: the newest seq queued, and the oldest
# transaction still running anywhere on the server (the snapshot's xmin). A row's transaction
# may commit after a higher seq was seen (seq is drawn at insert, not at commit), which leaves
# the first unchanged; but once that transaction and every transaction older than it have
# ended, xmin has moved past it. So each commit is seen at the latest when the oldest writer
# older than it ends, and at once in the usual case, where it is the oldest itself. A requeue
# or a resume, which draw no seq, are seen the same way. xmin moves with every write on the
# server, so a busy server wakes the processors at each look: a claim that finds nothing
# costs an index probe. The seq comes from each queue partition's unique index, backwards.
WATCH = f"SELECT (SELECT max(seq) FROM {OUTBOX_QUEUE}), pg_snapshot_xmin(pg_current_snapshot())"
_UNSEEN = object()  # what the poll saw before its first look, or after an outage

# One round trip, in the batch's transaction; router/relay/store/postgres_sql.py has the
# function and why each clause is there.
CLAIM = f"SELECT * FROM {FN_CLAIM}($1, $2, $3, $4, $5, $6)"

# All outcomes of one batch in one round trip, before the batch's commit; also in postgres_sql.py.
MARK = f"SELECT {FN_MARK}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"

RECORD_CIRCUIT = f"""
INSERT INTO {TARGETS} (target, circuit, circuit_since, circuit_worker, circuit_error)
VALUES ($1, $2, now(), $3, $4)
ON CONFLICT (target) DO UPDATE
SET circuit = EXCLUDED.circuit, circuit_since = EXCLUDED.circuit_since,
    circuit_worker = EXCLUDED.circuit_worker, circuit_error = EXCLUDED.circuit_error
"""

# The heartbeat of a batch still being published, in its transaction (see ``extend``).
EXTEND = "SELECT set_config('idle_in_transaction_session_timeout', $1, true)"

# A batch's transaction holds its target (router_claim()): a worker that goes silent with one
# open (its host cut off from the database, or frozen) must lose it soon, or every host waits.
# The server ends a session idle in its transaction for _HOLD seconds, and a live worker's run
# says it is there every _BEAT seconds, whatever it waits for (acks from a slow broker, say).
# Only an event loop stalled for _HOLD - _BEAT seconds loses a batch it was still sending; its
# rows are then sent again by whoever claims them next (at-least-once).
_HOLD = 2.0
_BEAT = 0.5

# Pending rows are not asked about: the claim that ran just before took every pending row it
# could, so one it left waits behind a failed row of its stream, and becomes claimable when
# that row's retry falls due, which this does return. Counting it as due now had an idle
# processor claim in vain every 50 ms. ix_router_outbox_stream (failed rows) serves it.
NEXT_DUE = f"""
SELECT extract(epoch FROM (SELECT min(available_at) FROM {OUTBOX_QUEUE}
                           WHERE target = $1 AND status = 'failed') - now())::float8
"""


PAUSED = f"SELECT paused FROM {TARGETS} WHERE target = $1"


# How many rows of each of an atomic target's units (their xids) the target has open or set
# aside: a unit is whole in a claim only when it holds them all. One dive into
# ix_router_outbox_unit (0018) per unit, with its predicate word for word; the claim gave each
# row's xid (0020). A dive per unit, not ``xid = ANY(...)``: PostgreSQL took the array only as
# a filter over the index's entries of the target, every queued row of it (29 ms for 170
# units on a 6,000-row backlog, against 1 ms).
UNIT_ROWS = f"""
SELECT x.id,
       (SELECT count(*) FROM {OUTBOX_QUEUE} u
        WHERE u.target = $1 AND u.xid = x.id::text::xid8
          AND u.status IN ('pending', 'failed', 'held', 'parked'))
FROM unnest($2::bigint[]) AS x(id)
"""


def _rows(records: Sequence[Any]) -> list[ClaimedRow]:
    """The rows of a claim's records (none when nothing was due, or the target was busy: a
    NULL seq), in outbox order."""
    if not records or records[0][0] is None:
        return []
    rows = [
        ClaimedRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], tuple(r[8] or ()), unit=r[7])
        for r in records
    ]
    rows.sort(key=lambda r: r.seq)  # a CTE's order is not promised
    return rows


class PostgresStore:
    """A lazily opened asyncpg pool plus a LISTEN connection for wake-ups."""

    kind = "postgresql"
    pump = TransactionRuns  # see router_claim(): one batch of a target in flight at a time

    def __init__(
        self,
        name: str,
        dsn: str,
        *,
        pool_size: int = 4,
        vacuum_after: int = 50_000,
        durable: bool = False,
        wakeup: str = "auto",
    ) -> None:
        self.name = name
        self._wakeup_setting = wakeup  # auto | log | notify | poll (DatabaseSettings.wakeup)
        self._wakeup = Wakeup("starting", f"wakeup: {wakeup}")
        self.outage = Outage(name)
        self._async_commit = not durable  # see migration 0006
        self._dsn = dsn
        self._pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()
        self._held: dict[int, _Run] = {}  # the transaction of each batch in flight, by token
        self._upkeep = Upkeep(name, dsn, vacuum_after=vacuum_after)
        self._wake_locks = WakeLocks(name)

    async def claim(
        self,
        target: str,
        limit: int,
        worker: str,
        lease_seconds: float,
        after: Claim | None = None,
        *,
        units: bool = False,
    ) -> Claim:
        """Lock up to ``limit`` due rows of ``target``, oldest first, streams in order, in a
        transaction that stays open until its batches are marked or released (the rows'
        lease). Busy, without rows, while another batch of the target is in flight (see
        router_claim()). ``after``: a batch of this store still held, whose transaction this
        claim joins, taking the rows after it; the transaction then commits with the mark of
        the last of its batches. ``units``: see ``OutboxStore.claim`` (``_units``)."""
        token = new_token()
        hold = min(lease_seconds, _HOLD)
        if after is not None:
            return await self._claim_after(target, limit, worker, hold, after, token, units)
        pool = await self._open()
        try:
            conn = await pool.acquire()
        except DB_ERRORS as exc:
            raise DatabaseError(f"{self.name}: {describe_error(exc)}") from exc
        run = _Run(pool, conn, hold=hold, labels={"database": self.name, "target": target})
        try:
            await conn.execute("BEGIN")
            records = await conn.fetch(CLAIM, target, limit, worker, hold, self._async_commit, 0)
            rows = _rows(records)
            if units and rows:
                await self._units(conn, target, rows, worker, hold)
        except BaseException as exc:
            await run.end()  # cancelled (stop) or failed: nothing of it is kept
            _raise_as_database_error(self.name, exc)
        if not records or records[0][0] is None:  # nothing due, or busy (a NULL seq)
            try:
                await run.commit()
            except BaseException as exc:  # the session ended under it (database dropped...)
                await run.end()
                _raise_as_database_error(self.name, exc)
            return Claim(token, [], busy=bool(records))
        return self._held_claim(run, token, rows)

    async def _claim_after(
        self,
        target: str,
        limit: int,
        worker: str,
        hold: float,
        after: Claim,
        token: int,
        units: bool,
    ) -> Claim:
        run = self._held.get(after.token)
        if run is None or run.broken or not after.rows:
            raise BatchLost(f"{self.name}: batch {after.token} is no longer held")
        last = max(row.seq for row in after.rows)
        try:
            async with run.lock:
                records = await run.conn.fetch(
                    CLAIM, target, limit, worker, hold, self._async_commit, last
                )
                rows = _rows(records)
                if units and rows:
                    await self._units(run.conn, target, rows, worker, hold)
        except BaseException as exc:
            # The transaction cannot be trusted: its batches are lost.
            if isinstance(exc, Exception):
                run.lost(describe_error(exc))
            run.broken = True
            _raise_as_database_error(self.name, exc)
        if not records or records[0][0] is None:  # nothing due, or busy (the ring's gate)
            return Claim(token, [], busy=bool(records))
        return self._held_claim(run, token, rows)

    async def _units(
        self, conn: Any, target: str, rows: list[ClaimedRow], worker: str, hold: float
    ) -> None:
        """An atomic target's claim made whole, in the claim's transaction
        (``router.relay.store.units``): each row's unit is its transaction's id, and the
        claim claims on as a claim in its run would. ``rows`` is extended in place."""

        unit_of = {row.seq: row.unit for row in rows}  # the claim's xids (0020)

        async def count(seqs: Sequence[int]) -> list[tuple[int, int | None, int]]:
            units = sorted({u for seq in seqs if (u := unit_of[seq]) is not None})
            totals = dict(list(await conn.fetch(UNIT_ROWS, target, units))) if units else {}
            return [(seq, unit_of[seq], totals.get(unit_of[seq], 0)) for seq in seqs]

        async def claim_on(after: int, limit: int) -> list[ClaimedRow]:
            more = _rows(
                await conn.fetch(CLAIM, target, limit, worker, hold, self._async_commit, after)
            )
            unit_of.update((row.seq, row.unit) for row in more)
            return more

        await complete_units(rows, count, claim_on)

    def _held_claim(self, run: _Run, token: int, rows: list[ClaimedRow]) -> Claim:
        run.batches[token] = len(rows)
        self._held[token] = run
        run.beat()
        return Claim(token, rows)

    async def mark(self, target: str, token: int, marks: Marks) -> None:
        """Write the batch's outcomes in its transaction, one statement; commit when it is the
        last batch of the transaction still open. Untried rows need nothing: the commit
        unlocks them as they were. Raises ``BatchLost`` when the transaction is gone (its rows
        are queued again, and will be delivered again)."""
        run = self._held.pop(token, None)
        if run is None or run.broken:
            if run is not None:
                await self._leave(run, token)
            raise BatchLost(f"{self.name}: batch {token} is no longer held (released or ended)")
        self._upkeep.marked(len(marks))
        receipts, reported = marks.receipts, marks.reported
        try:
            async with run.lock:
                if len(marks) > len(marks.untried):  # any outcome to write
                    await run.conn.execute(
                        MARK,
                        marks.published,
                        [receipts.get(seq) for seq in marks.published] if receipts else None,
                        [s for s, _, _ in marks.failed],
                        [d for _, d, _ in marks.failed],
                        [e for _, _, e in marks.failed],
                        [s for s, _ in marks.abandoned],
                        [e for _, e in marks.abandoned],
                        target,
                        sorted({key for key, _ in reported}),
                        [message_id for _, message_id in reported],
                        [s for s, _ in marks.held],
                        [e for _, e in marks.held],
                        [s for s, _, _ in marks.parked],
                        [e for _, _, e in marks.parked],
                    )
                del run.batches[token]
                if not run.batches:
                    await run.commit()
        except BaseException as exc:
            if isinstance(exc, Exception):
                run.lost(describe_error(exc))
            run.broken = True
            await self._leave(run, token)
            if not isinstance(exc, Exception):
                raise
            raise BatchLost(f"{self.name}: batch not marked: {describe_error(exc)}") from exc

    async def release(self, target: str, token: int, seqs: Sequence[int]) -> None:
        """Give the batch back untried: a mark with no outcomes. Its transaction commits (the
        other batches' outcomes, written) when it was the last open one; a transaction that can
        no longer be trusted is rolled back, and its rows are queued again all the same."""
        if token in self._held:
            with contextlib.suppress(BatchLost):
                await self.mark(target, token, Marks())

    async def _leave(self, run: _Run, token: int) -> None:
        """A batch of a broken run is done with: the last one out closes the connection."""
        run.batches.pop(token, None)
        if not run.batches:
            await run.end()

    async def extend(self, target: str, token: int, lease_seconds: float) -> int:
        """A live batch keeps its rows for as long as its session lives: one statement sets
        the session's idle limit for this transaction to ``lease_seconds`` (and, being a
        statement, starts that count again) and shows the session is still there. The rows it
        holds: all of them, or none."""
        run = self._held.get(token)
        if run is None or run.broken:
            return 0
        try:
            async with run.lock:
                # The session, not a time, holds the rows: the run's heartbeat keeps it; this
                # says once more that it is there.
                await run.conn.execute(EXTEND, str(math.ceil(run.hold * 1000)))
        except DB_ERRORS as exc:
            run.lost(describe_error(exc))
            raise DatabaseError(f"{self.name}: {describe_error(exc)}") from exc
        return run.batches.get(token, 0)

    async def next_due(self, target: str) -> float | None:
        """Seconds until the earliest retry or lease end, from the database's clock."""
        async with self._connection() as conn:
            value = await conn.fetchval(NEXT_DUE, target)
        return None if value is None else max(0.0, float(value))

    async def paused(self, target: str) -> bool:
        """Whether the target is paused."""
        async with self._connection() as conn:
            return bool(await conn.fetchval(PAUSED, target))

    async def record_circuit(self, target: str, state: str, worker: str, error: str | None) -> None:
        """Upsert the target's circuit state into router_targets."""
        async with self._connection() as conn:
            await conn.execute(RECORD_CIRCUIT, target, state, worker, error)

    async def check_schema(self) -> None:
        """Check the server answers and the router's tables are at this router's migration."""
        async with self._connection() as conn:
            revision = None
            if await conn.fetchval(f"SELECT to_regclass('{VERSION_TABLE}') IS NOT NULL"):
                revision = await conn.fetchval(f"SELECT version_num FROM {VERSION_TABLE}")
        problem = schema_problem(self.name, revision)
        if problem is not None:
            raise problem

    @property
    def wakeup(self) -> Wakeup:
        """The wake-up in use (``log``, ``notify``, ``poll``; ``starting`` until ``watch``
        decides) and why, for ``check`` and ``status``."""
        return self._wakeup

    async def watch(self, wake: Wake) -> None:
        """Call ``wake`` when rows may have been added, as ``wakeup`` says: from the log
        (falling back to LISTEN whenever it is not available), LISTEN, or not at all (poll)."""
        setting = self._wakeup_setting
        if setting == "poll":
            self._set_wakeup("poll", "configured")
            await self._poll(wake)
            return
        if setting == "notify":
            self._set_wakeup("notify", "configured")
            await self._listen(wake)
            return
        problem, answered = await self._log_problem()
        if problem is not None and answered and setting == "auto":
            # Probed once: a server that cannot do it now will not until a DBA acts.
            self._set_wakeup("notify", problem, fallback=True)
            await self._listen(wake)
            return
        await self._follow(wake, problem)

    async def probe_wakeup(self) -> Wakeup:
        """The wake-up ``watch`` would pick now, from one read-only query and without a
        follower (``router check``, ``router status``): ``notify`` with what keeps the log
        off, or ``log``. A replication connection's refusal (``pg_hba.conf``, no free slot)
        shows only when ``watch`` tries; with ``wakeup: log`` it then retries on ``notify``."""
        setting = self._wakeup_setting
        if setting in ("poll", "notify"):
            return Wakeup(setting, f"wakeup: {setting}")
        problem, answered = await self._log_problem()
        if not answered:
            raise DatabaseError(f"{self.name}: {problem}")
        if problem is not None:
            return Wakeup("notify", problem)
        return Wakeup("log", "wal_level, role and publication allow it")

    async def _log_problem(self) -> tuple[str | None, bool]:
        """What keeps this server from waking the relay from its log (None: nothing seen),
        and whether the server answered (False: it could not be asked, so nothing is known
        of its configuration yet)."""
        try:
            conn = await asyncpg.connect(self._dsn, timeout=10)
        except DB_ERRORS as exc:
            return f"cannot connect to check: {describe_error(exc)}", False
        try:
            return await log_problem(conn), True
        except DB_ERRORS as exc:
            return f"cannot check: {describe_error(exc)}", False
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 2)

    async def _follow(self, wake: Wake, problem: str | None) -> None:
        """Follow the log; LISTEN whenever it cannot be followed, from the moment it is lost
        until the follower streams again.

        Not both at once: once stage() notifies only while a relay listens, a relay that
        listens while the log serves it would make every writer pay NOTIFY's commit lock for
        nothing. The switch has no gap: the slot sees every commit after its creation, and a
        wake-up of every target once it streams covers those before; LISTEN, on until then,
        only keeps those prompt."""
        listening: asyncio.Task[None] | None = None
        delay = 0.5
        try:
            while True:
                if listening is None:
                    listening = asyncio.create_task(self._listen(wake))
                follower = Follower(self._dsn, wake)
                try:
                    await follower.start()
                except LogLost as exc:
                    reason = problem or str(exc)
                    self._set_wakeup("notify", f"{reason}; retrying", fallback=True)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, LOG_RETRY_MAX)
                    problem, answered = await self._log_problem()
                    if problem is not None and answered and self._wakeup_setting == "auto":
                        # Down when the router started; up now, but without what the log needs.
                        self._set_wakeup("notify", problem, fallback=True)
                        await listening
                    continue
                problem, delay = None, 0.5
                await _stop(listening)
                listening = None
                wake(None)  # committed while switching over: cheap, and never a miss
                self._set_wakeup("log", f"slot {follower.slot}")
                try:
                    await follower.run()
                except LogLost as exc:
                    wake(None)  # committed since the last message: look now
                    listening = asyncio.create_task(self._listen(wake))
                    log.warning("wakeup.log.lost", extra={"database": self.name, "error": str(exc)})
                    self._set_wakeup("notify", f"log lost: {exc}; reconnecting", fallback=True)
                finally:
                    follower.close()
                await asyncio.sleep(delay)
        finally:
            if listening is not None:
                await _stop(listening)

    def _set_wakeup(self, mechanism: str, reason: str, *, fallback: bool = False) -> None:
        """Record the wake-up in use, and log it when it changes."""
        if self._wakeup == (mechanism, reason):
            return
        self._wakeup = Wakeup(mechanism, reason)
        extra = {"database": self.name, "mechanism": mechanism, "reason": reason}
        if not fallback:
            log.info("wakeup.active", extra=extra)
            return
        # Asked for the log: a warning. Left to auto: what to change to have it.
        level = logging.WARNING if self._wakeup_setting == "log" else logging.INFO
        log.log(level, "wakeup.fallback", extra=extra)

    async def _listen(self, wake: Wake) -> None:
        """LISTEN for new rows; reconnect with backoff, and wake everyone after a gap."""
        delay = 0.5
        while True:
            try:
                conn = await asyncpg.connect(self._dsn, timeout=10)
            except DB_ERRORS as exc:
                self.outage.failed(describe_error(exc), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, LISTEN_RETRY_MAX)
                continue
            delay = 0.5
            self.outage.recovered()
            closed = asyncio.Event()
            try:
                conn.add_termination_listener(lambda _conn, ev=closed: ev.set())
                await conn.add_listener(CHANNEL, lambda *args: wake(_targets(args[3])))
                self._wake_locks.attach(conn, wake)
                log.debug("db.listen.started", extra={"database": self.name})
                wake(None)  # anything committed while we were not listening
                await closed.wait()
                log.warning("db.listen.lost", extra={"database": self.name})
            except DB_ERRORS as exc:
                self.outage.failed(describe_error(exc))
            finally:
                self._wake_locks.detach()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), 2)

    async def _poll(self, wake: Wake) -> None:
        """Look for changes (``WATCH``) every ``WATCH_FAST`` seconds; wake everyone on one,
        and once more at the next look, for a commit that lagged its seq's neighbours."""
        seen: object = _UNSEEN
        recheck = False
        delay = WATCH_FAST
        while True:
            try:
                async with self._connection() as conn:
                    look = tuple(await conn.fetchrow(WATCH))
            except DatabaseError as exc:
                self.outage.failed(str(exc), retry_in=delay)
                seen = _UNSEEN  # wake everyone once the database answers again
                await asyncio.sleep(delay)
                delay = min(delay * 2, LISTEN_RETRY_MAX)
                continue
            delay = WATCH_FAST
            self.outage.recovered()
            changed = look != seen
            if changed or recheck:
                wake(None)
            seen, recheck = look, changed
            await asyncio.sleep(WATCH_FAST)

    async def idle(self, target: str) -> float | None:
        """``target``'s processor found nothing to claim: it takes its wake lock in the
        background and is woken if it must look again (``postgres_wake.WakeLocks``)."""
        return await self._wake_locks.idle(target)

    def busy(self, target: str) -> None:
        """``target``'s processor is awake: its stagers need not notify."""
        self._wake_locks.busy(target)

    async def close(self) -> None:
        """Close the pool; a batch still held is rolled back (its rows stay queued)."""
        runs, self._held = set(self._held.values()), {}
        for run in runs:
            await run.end()
        await self._upkeep.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pool.close(), 5)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[Any]:
        pool = await self._open()
        try:
            async with pool.acquire() as conn:
                yield conn
        except (asyncpg.UndefinedTableError, asyncpg.UndefinedFunctionError):
            # Tables or functions dropped or rolled back under a running router.
            raise schema_problem(self.name, None) or DatabaseError(self.name) from None
        except DB_ERRORS as exc:
            raise DatabaseError(f"{self.name}: {describe_error(exc)}") from exc

    async def _open(self) -> asyncpg.Pool:
        if self._pool is not None:
            return self._pool
        async with self._opening:
            if self._pool is None:
                try:
                    self._pool = await asyncpg.create_pool(
                        self._dsn,
                        reset=_keep_session,
                        min_size=1,
                        max_size=self._pool_size,
                        timeout=10,
                        command_timeout=60,
                    )
                except DB_ERRORS as exc:
                    raise DatabaseError(
                        f"{self.name}: cannot connect: {describe_error(exc)}"
                    ) from exc
            return self._pool

    async def release_worker(self, worker: str) -> int:
        """A dead worker's batches ended with its connections: its rows are queued again
        already (or as soon as the server sees the connection go). Wake every processor of
        the database, so one that is idle takes them now."""
        async with self._connection() as conn:
            await conn.execute("SELECT pg_notify($1, '')", CHANNEL)
        return 0


async def _keep_session(_connection: Any) -> None:
    """asyncpg's default reset sends a statement on every release (unlock, UNLISTEN, RESET).
    Pool connections here never change session state (the claim's locks end with its
    transaction), so an idle router can stay silent."""


class _Run:
    """A transaction held open on a connection taken from the pool: the batches claimed in it
    (by token: their row counts), and a lock, so that a claim and a mark never share the
    connection at once."""

    def __init__(
        self, pool: asyncpg.Pool, conn: Any, *, hold: float, labels: dict[str, str]
    ) -> None:
        self.pool = pool
        self.conn = conn
        self.hold = hold  # the server ends the session after this long idle (seconds)
        self.batches: dict[int, int] = {}
        self.lock = asyncio.Lock()
        self.broken = False  # a statement failed: roll back, whatever was written
        self._beating: asyncio.Task[None] | None = None
        self._labels = labels

    def lost(self, error: str) -> None:
        """The session was found gone (the server ended it: this process was frozen or cut
        off for longer than ``hold``), or a statement of it failed: its batches are another
        worker's to send. Logged once per run, wherever it is found (heartbeat, claim, mark,
        extend, release): a frozen worker may wake, give its batches back untried, and have
        nothing else say that they had been taken from it."""
        if not self.broken:
            log.warning(
                "batch.session_lost",
                extra={**self._labels, "batches": len(self.batches), "error": error},
            )
        self.broken = True

    def beat(self) -> None:
        """Start the heartbeat (once): a statement every _BEAT seconds while the
        connection is not in use, so the session is never idle for ``hold``."""
        if self._beating is None:
            self._beating = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        limit = str(math.ceil(self.hold * 1000))
        interval = min(_BEAT, self.hold / 4)
        while not self.broken:
            await asyncio.sleep(interval)
            if self.lock.locked():  # a claim or mark is a sign of life already
                continue
            try:
                async with self.lock:
                    await self.conn.execute(EXTEND, limit)
            except Exception as exc:  # the session is gone, or going: its batches are lost
                self.lost(describe_error(exc))

    async def commit(self) -> None:
        """Commit, and back to the pool."""
        await self.conn.execute("COMMIT")
        await self.end()

    async def end(self) -> None:
        """Back to the pool. A transaction still open (failed, cancelled, released) is not
        rolled back over a connection in an unknown state: the connection is closed, which
        ends it, and the pool opens another."""
        if self._beating is not None and self._beating is not asyncio.current_task():
            self._beating.cancel()
        # A connection that closed under it may have gone back to the pool already.
        with contextlib.suppress(asyncpg.InterfaceError):
            if not self.conn.is_closed() and self.conn.is_in_transaction():
                self.conn.terminate()
        with contextlib.suppress(Exception):
            await self.pool.release(self.conn)


def _raise_as_database_error(name: str, exc: BaseException) -> NoReturn:
    """Re-raise what a claim ran into: cancellation as it is, driver errors as DatabaseError
    (tables or functions gone: the schema's error)."""
    if isinstance(exc, (asyncpg.UndefinedTableError, asyncpg.UndefinedFunctionError)):
        raise schema_problem(name, None) or DatabaseError(name) from exc
    if isinstance(exc, DB_ERRORS):
        raise DatabaseError(f"{name}: {describe_error(exc)}") from exc
    raise exc


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait until it has closed what it opened."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _targets(payload: str) -> set[str] | None:
    return set(payload.split(",")) if payload else None
