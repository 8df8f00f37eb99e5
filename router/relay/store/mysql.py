"""The outbox on MySQL 8.0+ and MariaDB 10.6+, through asyncmy (the ``mysql`` extra).

Claims use ``FOR UPDATE SKIP LOCKED`` with a lease, as on PostgreSQL; the statements, and why
each is there, are in ``router.relay.store.mysql_sql``. A server without ``SKIP LOCKED``
(MariaDB before 10.6, MySQL before 8.0) is refused when the store opens.

MySQL has no NOTIFY. A commit through ``Outbox`` in the serving process wakes its processors
directly (``router._local``). What other processes commit, ``watch`` learns as the database's
``wakeup`` setting says:

- ``log``: from the binlog, within milliseconds (``router.relay.store.mysql_binlog``). A poll
  still runs beside it for requeues and resumes (updates, which the binlog follower ignores):
  one cheap statement every quarter second after a change, backing off to one every
  ``watch_interval`` seconds (15) while nothing changes. Whenever the binlog connection is
  lost, that poll runs every ``WATCH_FAST`` seconds until the follower is back.
- ``poll``: the poll alone, every ``WATCH_FAST`` seconds (20 statements a second).
- ``auto`` (the default): ``log`` when the server allows it (binlog on in ROW format, the
  privileges a replica needs), else ``poll``; ``wakeup`` says which is active, and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import re
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import asyncmy
from asyncmy.cursors import Cursor
from asyncmy.errors import MySQLError

from envelopes import DatabaseError
from router.relay.pumps import Overlapping
from router.relay.store import mysql_sql as sql
from router.relay.store.base import (
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

__all__ = ["MysqlStore", "unsupported_server"]

log = logging.getLogger(__name__)

SERVER_VERSION = "SELECT VERSION()"

# The watcher's pace: right after a change, then doubling up to the store's watch_interval;
# every WATCH_FAST seconds when the poll is the only wake-up (the statement costs the server
# about 0.1 ms: docs/production.md has the figures).
WATCH_BUSY = 0.25
WATCH_IDLE = 15.0
WATCH_FAST = 0.05
# A lost binlog connection is tried again after this long, doubling up to RECONNECT_MAX.
RECONNECT_FIRST = 1.0
RECONNECT_MAX = 30.0
BINLOG_PACKAGE = "pymysqlreplication"

_NO_SUCH_TABLE = 1146
_DB_ERRORS = (MySQLError, OSError, TimeoutError)
_UNKNOWN = object()  # what the watcher saw before its first look, or after an outage


def unsupported_server(version: str) -> str | None:
    """Why a server reporting ``VERSION()`` cannot run the claim (None: it can)."""
    text = version.removeprefix("5.5.5-")  # how old MariaDB clients were told it is MariaDB
    mariadb = "mariadb" in text.lower()
    numbers = tuple(int(n) for n in re.findall(r"\d+", text.partition("-")[0])[:2])
    if numbers >= ((10, 6) if mariadb else (8, 0)):
        return None
    server = "MariaDB" if mariadb else "MySQL"
    return (
        f"{server} {text} has no SELECT ... FOR UPDATE SKIP LOCKED, which the router's claim "
        "needs; use MariaDB 10.6 or MySQL 8.0 or newer"
    )


class MysqlStore:
    """A lazily opened asyncmy pool; each claim is one short READ COMMITTED transaction."""

    kind = "mysql"
    pump = Overlapping  # leases: claims overlap publishing

    def __init__(
        self,
        name: str,
        connect_args: dict[str, Any],
        *,
        pool_size: int = 4,
        watch_interval: float = WATCH_IDLE,
        wakeup: str = "auto",
    ) -> None:
        self.name = name
        self.outage = Outage(name)
        self.watch_interval = watch_interval
        self.wakeup = Wakeup("starting", "not watching yet")
        """The wake-up active now, and why: ``watch`` keeps it current."""
        self._wakeup_setting = wakeup
        self._connect_args = connect_args
        self._pool_size = pool_size
        self._pool: Any = None
        self._opening = asyncio.Lock()

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
        candidates = await self._candidates(target, limit)
        if not candidates:  # an idle target costs this one statement
            return Claim(token, [])
        async with self._transaction() as cursor:
            paused, gaps, parked = await self._lock_target(cursor, target)
            if paused:
                return Claim(token, [])
            if parked:
                await self._park_behind(cursor, target, limit)
            candidates = await self._candidates(target, limit, cursor)
            if not candidates:
                return Claim(token, [])
            held_back: set[str] = set()
            rows = await self._lock_rows(cursor, target, candidates, held_back)
            if units and rows:
                await self._units(cursor, target, rows, held_back)
            if rows:
                leased = [r.seq for r in rows]
                await cursor.execute(
                    sql.LEASE.format(seqs=sql.in_list(len(leased))),
                    [worker, token, round(lease_seconds * 1_000_000), *leased],
                )
            keys = sorted({r.stream_key for r in rows if r.stream_key is not None})
            if gaps and keys:
                await cursor.execute(sql.gaps_of(len(keys)), [target, *keys])
                name_gaps(rows, await cursor.fetchall())
        return Claim(token, rows)

    async def _lock_rows(
        self,
        cursor: Cursor,
        target: str,
        candidates: Sequence[tuple[int, str | None]],
        held_back: set[str],
    ) -> list[ClaimedRow]:
        """Lock the candidates a claim may take (``_in_stream_order``; ``held_back``: the
        streams it passed over, now and in earlier steps of the claim), in outbox order."""
        seqs = [seq for seq, _ in candidates]
        await cursor.execute(sql.LOCK_ROWS.format(seqs=sql.in_list(len(seqs))), [target, *seqs])
        records = _in_stream_order(candidates, await cursor.fetchall(), held_back)
        return [ClaimedRow(r[0], r[1], r[2], r[3], r[4] + 1, r[5], _epoch(r[6])) for r in records]

    async def _units(
        self, cursor: Cursor, target: str, rows: list[ClaimedRow], held_back: set[str]
    ) -> None:
        """An atomic target's claim made whole before its lease (``complete_units``): its
        own rows, still pending, hold no later row of their streams back."""

        async def count(seqs: Sequence[int]) -> list[Any]:
            await cursor.execute(sql.UNITS.format(seqs=sql.in_list(len(seqs))), list(seqs))
            return list(await cursor.fetchall())

        async def claim_on(after: int, limit: int) -> list[ClaimedRow]:
            await cursor.execute(sql.CANDIDATES_AFTER, [target, after, target, limit] * 3 + [limit])
            candidates = list(await cursor.fetchall())
            if not candidates:
                return []
            return await self._lock_rows(cursor, target, candidates, held_back)

        await complete_units(rows, count, claim_on)

    async def mark(self, target: str, token: int, marks: Marks) -> None:
        """An UPDATE per kind of outcome, each fenced by the claim's token.

        Each commits on its own: marks are idempotent (a row marked once is no longer held
        under the token), so the processor's retry of a half-written batch is harmless. A
        batch that abandoned a row or closed a gap is marked in one transaction instead, so
        that a row is never abandoned without its gap recorded, nor published with the gaps
        it named left open (two statements more, only then); so is one that parked a stream's
        head, with the rest of its stream.
        """
        whole = bool(marks.abandoned or marks.reported or marks.parked)
        async with self._transaction() if whole else self._cursor() as cursor:
            published, receipts = marks.published, marks.receipts
            if published and receipts:
                await cursor.execute(
                    sql.MARK_PUBLISHED_RECEIPTS.format(
                        receipts=sql.when_seq(len(published)), seqs=sql.in_list(len(published))
                    ),
                    [*_flat([(s, receipts.get(s)) for s in published]), *published, token],
                )
            elif published:
                await cursor.execute(
                    sql.MARK_PUBLISHED.format(seqs=sql.in_list(len(published))),
                    [*published, token],
                )
            if marks.failed:
                seqs = [seq for seq, _, _ in marks.failed]
                delays = [(seq, round(delay * 1_000_000)) for seq, delay, _ in marks.failed]
                errors = [(seq, error) for seq, _, error in marks.failed]
                await cursor.execute(
                    sql.MARK_FAILED.format(
                        delays=sql.when_seq(len(seqs)),
                        errors=sql.when_seq(len(seqs)),
                        seqs=sql.in_list(len(seqs)),
                    ),
                    [*_flat(delays), *_flat(errors), *seqs, token],
                )
            if marks.abandoned:
                seqs = [seq for seq, _ in marks.abandoned]
                await cursor.execute(
                    sql.MARK_ABANDONED.format(
                        errors=sql.when_seq(len(seqs)), seqs=sql.in_list(len(seqs))
                    ),
                    [*_flat(marks.abandoned), *seqs, token],
                )
                await cursor.execute(
                    sql.RECORD_GAPS.format(seqs=sql.in_list(len(seqs))), [*seqs, token]
                )
            for seq, error in marks.held:
                await cursor.execute(sql.MARK_KEPT, ["held", error, seq, token])
            parked = []  # the heads this mark parked (still under its token)
            for seq, key, error in marks.parked:
                await cursor.execute(sql.MARK_KEPT, ["parked", error, seq, token])
                if cursor.rowcount == 1:
                    parked.append((key, seq))
            if marks.reported:  # after the gaps above: a later row of the batch may name one
                keys = sorted({key for key, _ in marks.reported})
                ids = [message_id for _, message_id in marks.reported]
                await cursor.execute(sql.close_gaps(len(keys), len(ids)), [target, *keys, *ids])
            if marks.untried:
                await self._release(cursor, token, marks.untried)
            for key, seq in parked:  # after the release: the batch's rows of it are queued
                await cursor.execute(sql.PARK_FOLLOWERS, [target, key, seq])

    async def release(self, target: str, token: int, seqs: Sequence[int]) -> None:
        """Return untried rows to the queue without counting an attempt."""
        if seqs:
            async with self._cursor() as cursor:
                await self._release(cursor, token, seqs)

    async def extend(self, target: str, token: int, lease_seconds: float) -> int:
        """Hold the rows still under ``token`` until ``lease_seconds`` from now."""
        async with self._cursor() as cursor:
            await cursor.execute(sql.EXTEND, [round(lease_seconds * 1_000_000), target, token])
            count = cursor.rowcount  # typed object, as in release_worker
            return count if isinstance(count, int) else 0

    async def next_due(self, target: str) -> float | None:
        """Seconds until the earliest open row is due, from the database's clock."""
        async with self._cursor() as cursor:
            await cursor.execute(sql.NEXT_DUE, [target, target])
            now, *due = await cursor.fetchone()
        times = [moment for moment in due if moment is not None]
        return max(0.0, (min(times) - now).total_seconds()) if times else None

    async def paused(self, target: str) -> bool:
        """Whether the target is paused."""
        async with self._cursor() as cursor:
            await cursor.execute(sql.PAUSED, [target])
            row = await cursor.fetchone()
        return bool(row and row[0])

    async def record_circuit(self, target: str, state: str, worker: str, error: str | None) -> None:
        """Upsert the target's circuit state into router_targets."""
        async with self._cursor() as cursor:
            await cursor.execute(
                sql.RECORD_CIRCUIT, [target, state, worker, error, state, worker, error]
            )

    async def check_schema(self) -> None:
        """Check the server answers and the router's tables are at this router's migration."""
        revision = None
        async with self._cursor() as cursor:
            await cursor.execute(sql.CHECK_SCHEMA, [VERSION_TABLE])
            (found,) = await cursor.fetchone()
            if found:
                await cursor.execute(f"SELECT version_num FROM {VERSION_TABLE}")
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

    async def watch(self, wake: Wake) -> None:
        """Wake the processors when rows arrive, are requeued, or a target is resumed: from
        the binlog or a poll, as the ``wakeup`` setting and the server allow (the module's
        docstring says how each works)."""
        pace = _Pace(fast=self._wakeup_setting == "poll")
        poll = asyncio.create_task(self._poll(wake, pace), name=f"poll:{self.name}")
        try:
            if self._wakeup_setting == "poll":
                self._use(Wakeup("poll", "wakeup: poll"))
            else:
                await self._follow(wake, pace)
            await poll
        finally:
            poll.cancel()
            await asyncio.gather(poll, return_exceptions=True)

    async def probe_wakeup(self) -> Wakeup:
        """The wake-up ``watch`` would pick now, from two cheap statements (``router check``).
        It cannot see ``REPLICATION SLAVE``: only following the binlog tries that."""
        if self._wakeup_setting == "poll":
            return Wakeup("poll", "wakeup: poll")
        missing = _binlog_package_missing()
        if missing is not None:
            return Wakeup("poll", missing)
        from router.relay.store import mysql_binlog as binlog

        async with self._cursor() as cursor:
            await cursor.execute("SELECT @@log_bin, @@binlog_format")
            log_bin, binlog_format = await cursor.fetchone()
            try:
                await cursor.execute(binlog.BINLOG_STATUS[0])
                status = await cursor.fetchone()
            except MySQLError as exc:
                problem = binlog.denied(exc)
                if problem is None:
                    raise
                return Wakeup("poll", problem)
        problem = binlog.binlog_problem(log_bin, binlog_format, status)
        return Wakeup("poll", problem) if problem else Wakeup("log", "the binlog is on, ROW")

    async def _follow(self, wake: Wake, pace: _Pace) -> None:
        """Follow the binlog, polling fast whenever it is not connected; returns only when
        ``auto`` finds the server does not allow it (the poll goes on alone)."""
        auto = self._wakeup_setting == "auto"
        missing = _binlog_package_missing()
        if missing is not None:
            self._fall_back(pace, missing)
            if auto:
                return
        from router.relay.store.mysql_binlog import BinlogFollower, BinlogUnusable

        follower = BinlogFollower(self.name, self._connect_args)
        delay, ever = RECONNECT_FIRST, False

        def connected() -> None:
            nonlocal delay, ever
            delay, ever = RECONNECT_FIRST, True
            pace.slow()
            self._use(Wakeup("log", "following the binlog"))
            wake(None)  # for commits made before the session started

        while True:
            try:
                await follower.follow(wake, connected)
                reason = "the binlog connection ended"
            except BinlogUnusable as exc:
                if auto and not ever:
                    self._fall_back(pace, str(exc))
                    return
                reason = str(exc)
            except DatabaseError as exc:
                reason = f"binlog connection lost, reconnecting: {exc}"
            self._fall_back(pace, reason)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX)

    def _fall_back(self, pace: _Pace, reason: str) -> None:
        pace.fast_now()
        self._use(Wakeup("poll", reason))

    def _use(self, wakeup: Wakeup) -> None:
        """Make ``wakeup`` the active one; log it when it changed."""
        if wakeup == self.wakeup:
            return
        self.wakeup = wakeup
        extra = {"database": self.name, "mechanism": wakeup.mechanism, "reason": wakeup.reason}
        if wakeup.mechanism == "poll" and self._wakeup_setting != "poll":
            log.warning("wakeup.fallback", extra=extra)
        else:
            log.info("wakeup.active", extra=extra)

    async def _poll(self, wake: Wake, pace: _Pace) -> None:
        """Look for changes (``mysql_sql.WATCH``) as ``pace`` says; wake everyone on one.

        A transaction that got a lower ``seq`` may commit just after a higher one was seen,
        without changing it: after each change the next look wakes everyone once more.
        """
        seen: object = _UNKNOWN
        high: datetime | None = None  # the newest pending row's time: the highest seen yet
        interval = WATCH_BUSY
        recheck = False
        while True:
            try:
                seq, pending, *others = await self._look()
            except DatabaseError as exc:
                self.outage.failed(str(exc), retry_in=interval)
                seen = _UNKNOWN  # wake everyone once the database answers again
                await asyncio.sleep(interval)
                interval = min(interval * 2, self.watch_interval)
                continue
            self.outage.recovered()
            rose = pending is not None and (high is None or pending > high)
            high = pending if rose else high
            changed = (seq, *others) != seen or rose
            if changed or recheck:
                wake(None)
            seen, recheck = (seq, *others), changed
            interval = WATCH_BUSY if changed else min(interval * 2, self.watch_interval)
            await pace.wait(interval)

    async def close(self) -> None:
        """Close the pool."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pool.wait_closed(), 5)

    async def _candidates(
        self, target: str, limit: int, cursor: Cursor | None = None
    ) -> list[tuple[int, str | None]]:
        """The rows a claim would pick now, ``(seq, stream_key)`` in outbox order."""
        params = [target, target, limit] * 3 + [limit]
        if cursor is not None:
            await cursor.execute(sql.CANDIDATES, params)
            return list(await cursor.fetchall())
        async with self._cursor() as own:
            await own.execute(sql.CANDIDATES, params)
            return list(await own.fetchall())

    async def _lock_target(self, cursor: Cursor, target: str) -> tuple[bool, bool, bool]:
        """Lock the target's row (claims of one target take turns); whether it is paused,
        whether it has any gap marker, and whether it has a parked row (a new row: not
        known, so maybe)."""
        await cursor.execute(sql.LOCK_TARGET, [target, target, target])
        row = await cursor.fetchone()
        if row is None:
            await cursor.execute(sql.ENSURE_TARGET, [target])
            return False, True, True
        return bool(row[0]), bool(row[1]), bool(row[2])

    async def _park_behind(self, cursor: Cursor, target: str, limit: int) -> None:
        """Park the rows staged behind a parked row of their stream since, among the first
        ``limit`` queued rows of ``target`` (``mysql_sql.PARKED_BEHIND``)."""
        await cursor.execute(sql.PARKED_BEHIND, [target, limit, target, limit, limit, target])
        seqs = [seq for (seq,) in await cursor.fetchall()]
        if seqs:
            await cursor.execute(sql.PARK.format(seqs=sql.in_list(len(seqs))), seqs)

    async def _release(self, cursor: Cursor, token: int, seqs: Sequence[int]) -> None:
        await cursor.execute(sql.RELEASE.format(seqs=sql.in_list(len(seqs))), [*seqs, token])

    async def _look(self) -> tuple[Any, ...]:
        """What the watcher compares from one look to the next (``mysql_sql.WATCH``)."""
        async with self._cursor() as cursor:
            await cursor.execute(sql.WATCH)
            return tuple(await cursor.fetchone())

    @contextlib.asynccontextmanager
    async def _cursor(self) -> AsyncIterator[Cursor]:
        """A cursor on a pooled connection in autocommit: each statement commits."""
        pool = await self._open()
        try:
            async with pool.acquire() as conn, conn.cursor() as cursor:
                yield cursor
        except MySQLError as exc:
            if exc.args and exc.args[0] == _NO_SUCH_TABLE:
                # Tables dropped or rolled back under a running router.
                raise schema_problem(self.name, None) or DatabaseError(self.name) from None
            raise DatabaseError(f"{self.name}: {describe_error(exc)}") from exc
        except (OSError, TimeoutError) as exc:
            raise DatabaseError(f"{self.name}: {describe_error(exc)}") from exc

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[Cursor]:
        """A cursor in one transaction: COMMIT at the end, ROLLBACK on any error.

        A connection given back mid-transaction (cancelled) is closed by the pool, which makes
        the server roll back.
        """
        async with self._cursor() as cursor:
            conn = cursor.connection
            await conn.begin()
            try:
                yield cursor
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.shield(conn.rollback())
                raise
            await conn.commit()

    async def _open(self) -> Any:
        if self._pool is not None:
            return self._pool
        async with self._opening:
            if self._pool is None:
                try:
                    pool = await asyncmy.create_pool(
                        minsize=1,
                        maxsize=self._pool_size,
                        autocommit=True,
                        init_command=sql.SESSION,
                        connect_timeout=10,
                        **self._connect_args,
                    )
                except _DB_ERRORS as exc:
                    raise DatabaseError(
                        f"{self.name}: cannot connect: {describe_error(exc)}"
                    ) from exc
                try:
                    await self._check_server(pool)
                except BaseException:
                    pool.close()
                    raise
                self._pool = pool
            return self._pool

    async def _check_server(self, pool: Any) -> None:
        try:
            async with pool.acquire() as conn, conn.cursor() as cursor:
                await cursor.execute(SERVER_VERSION)
                (version,) = await cursor.fetchone()
        except _DB_ERRORS as exc:
            raise DatabaseError(f"{self.name}: cannot connect: {describe_error(exc)}") from exc
        problem = unsupported_server(str(version))
        if problem is not None:
            raise DatabaseError(f"{self.name}: {problem}")

    async def release_worker(self, worker: str) -> int:
        """Give back every row a dead ``worker`` holds, in one UPDATE. MySQL has no NOTIFY:
        the other processes' watchers notice (a newer pending ``available_at``) at their
        next look, within ``watch_interval``."""
        async with self._cursor() as cursor:
            await cursor.execute(sql.RELEASE_WORKER, [worker])
            count = cursor.rowcount  # asyncmy types it object; it is an int
            return count if isinstance(count, int) else 0


class _Pace:
    """How often the watcher's poll looks: fast while it is the only wake-up, else backing
    off; ``fast_now`` also cuts the current wait short."""

    def __init__(self, *, fast: bool) -> None:
        self.fast = fast
        self._nudge = asyncio.Event()

    def fast_now(self) -> None:
        """Poll every WATCH_FAST seconds from now on (the binlog is not connected)."""
        self.fast = True
        self._nudge.set()

    def slow(self) -> None:
        """Back off again (the binlog is connected)."""
        self.fast = False

    async def wait(self, interval: float) -> None:
        """Until the next look: WATCH_FAST when fast, else ``interval``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._nudge.wait(), WATCH_FAST if self.fast else interval)
        self._nudge.clear()


def _binlog_package_missing() -> str | None:
    """Why the binlog cannot be read here, when its package is not installed."""
    if importlib.util.find_spec(BINLOG_PACKAGE) is not None:
        return None
    return (
        f"the binlog reader is not installed ({BINLOG_PACKAGE}): pip install 'outbox-router[mysql]'"
    )


def _in_stream_order(
    candidates: Sequence[tuple[int, str | None]], locked: Sequence[Any], held_back: set[str]
) -> list[Any]:
    """The locked rows a claim may lease: once a candidate of a stream was skipped (another
    transaction holds it) or is no longer due, the stream's later candidates wait too
    (``held_back``, which this adds those streams to)."""
    by_seq = {record[0]: record for record in locked}
    leased = []
    for seq, key in candidates:
        record = by_seq.get(seq)
        if key is not None and (record is None or key in held_back):
            held_back.add(key)
            continue
        if record is not None:
            leased.append(record)
    return leased


def _flat(pairs: Sequence[tuple[int, object]]) -> list[object]:
    return [value for pair in pairs for value in pair]


def _epoch(moment: datetime | None) -> float | None:
    return None if moment is None else moment.replace(tzinfo=UTC).timestamp()
