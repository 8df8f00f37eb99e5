"""The outbox on MySQL 8.0+ and MariaDB 10.6+, through asyncmy (the ``mysql`` extra).

Claims use ``FOR UPDATE SKIP LOCKED`` with a lease, as on PostgreSQL; the statements, and why
each is there, are in ``router.relay.store.mysql_sql``. A server without ``SKIP LOCKED``
(MariaDB before 10.6, MySQL before 8.0) is refused when the store opens.

MySQL has no NOTIFY. A commit through ``Outbox`` in the serving process wakes its processors
directly (``router._local``); for what other processes do, ``watch`` polls the newest ``seq``
(new rows), the newest pending ``available_at`` (rows requeued) and the paused targets (a
resume), one cheap statement every quarter second after a change, backing off to one every
``watch_interval`` seconds (15: four statements a minute) while nothing changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import asyncmy
from asyncmy.cursors import Cursor
from asyncmy.errors import MySQLError

from envelopes import DatabaseError
from router.relay.store import mysql_sql as sql
from router.relay.store.base import (
    VERSION_TABLE,
    Claim,
    ClaimedRow,
    Marks,
    Wake,
    describe_error,
    new_token,
    schema_problem,
)
from router.relay.store.outage import Outage

__all__ = ["MysqlStore", "unsupported_server"]

log = logging.getLogger(__name__)

SERVER_VERSION = "SELECT VERSION()"

# The watcher's pace: right after a change, then doubling up to the store's watch_interval.
WATCH_BUSY = 0.25
WATCH_IDLE = 15.0

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
    holds_batches = False  # leases: claims overlap publishing

    def __init__(
        self,
        name: str,
        connect_args: dict[str, Any],
        *,
        pool_size: int = 4,
        watch_interval: float = WATCH_IDLE,
    ) -> None:
        self.name = name
        self.outage = Outage(name)
        self.watch_interval = watch_interval
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
        after: Claim | None = None,  # leases: never given (holds_batches is False)
    ) -> Claim:
        """Lease up to ``limit`` due rows of ``target``, oldest first, streams in order."""
        token = new_token()
        candidates = await self._candidates(target, limit)
        if not candidates:  # an idle target costs this one statement
            return Claim(token, [])
        async with self._transaction() as cursor:
            if await self._target_paused(cursor, target):
                return Claim(token, [])
            candidates = await self._candidates(target, limit, cursor)
            if not candidates:
                return Claim(token, [])
            seqs = [seq for seq, _ in candidates]
            await cursor.execute(sql.LOCK_ROWS.format(seqs=sql.in_list(len(seqs))), [target, *seqs])
            records = _in_stream_order(candidates, await cursor.fetchall())
            if records:
                leased = [r[0] for r in records]
                await cursor.execute(
                    sql.LEASE.format(seqs=sql.in_list(len(leased))),
                    [worker, token, round(lease_seconds * 1_000_000), *leased],
                )
        rows = [ClaimedRow(r[0], r[1], r[2], r[3], r[4] + 1, r[5], _epoch(r[6])) for r in records]
        return Claim(token, rows)

    async def mark(self, target: str, token: int, marks: Marks) -> None:
        """An UPDATE per kind of outcome, each fenced by the claim's token.

        Each commits on its own: marks are idempotent (a row marked once is no longer held
        under the token), so the processor's retry of a half-written batch is harmless.
        """
        async with self._cursor() as cursor:
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
            if marks.untried:
                await self._release(cursor, token, marks.untried)

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
        """Wake every processor when rows arrive, are requeued, or a target is resumed
        (``mysql_sql.WATCH`` says what it reads).

        A transaction that got a lower ``seq`` may commit just after a higher one was seen,
        without changing it: after each change the next look wakes everyone once more.
        """
        seen: object = _UNKNOWN
        high: datetime | None = None  # the newest pending row's time: the highest seen yet
        interval = WATCH_BUSY
        recheck = False
        while True:
            try:
                seq, pending, *paused = await self._look()
            except DatabaseError as exc:
                self.outage.failed(str(exc), retry_in=interval)
                seen = _UNKNOWN  # wake everyone once the database answers again
                await asyncio.sleep(interval)
                interval = min(interval * 2, self.watch_interval)
                continue
            self.outage.recovered()
            rose = pending is not None and (high is None or pending > high)
            high = pending if rose else high
            changed = (seq, *paused) != seen or rose
            if changed or recheck:
                wake(None)
            seen, recheck = (seq, *paused), changed
            interval = WATCH_BUSY if changed else min(interval * 2, self.watch_interval)
            await asyncio.sleep(interval)

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
        params = [target, limit] * 3 + [limit]
        if cursor is not None:
            await cursor.execute(sql.CANDIDATES, params)
            return list(await cursor.fetchall())
        async with self._cursor() as own:
            await own.execute(sql.CANDIDATES, params)
            return list(await own.fetchall())

    async def _target_paused(self, cursor: Cursor, target: str) -> bool:
        """Lock the target's row (claims of one target take turns); True if it is paused."""
        await cursor.execute(sql.LOCK_TARGET, [target])
        row = await cursor.fetchone()
        if row is None:
            await cursor.execute(sql.ENSURE_TARGET, [target])
            return False
        return bool(row[0])

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


def _in_stream_order(
    candidates: Sequence[tuple[int, str | None]], locked: Sequence[Any]
) -> list[Any]:
    """The locked rows a claim may lease: once a candidate of a stream was skipped (another
    transaction holds it) or is no longer due, the stream's later candidates wait too."""
    by_seq = {record[0]: record for record in locked}
    held_back: set[str] = set()
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
