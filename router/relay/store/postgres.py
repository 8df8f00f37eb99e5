"""The outbox on PostgreSQL, through asyncpg (the processor's hot path skips SQLAlchemy).

Claims use ``FOR UPDATE SKIP LOCKED`` with a lease, so any number of processors of one target,
in any number of processes, never hold the same row at once; a row whose lease expired (its
worker died) is claimable again. New rows announce themselves with ``NOTIFY router_outbox``,
whose payload names the targets; it is delivered only when the writer commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg

from envelopes import DatabaseError
from router.relay.store.base import (
    VERSION_TABLE,
    Claim,
    ClaimedRow,
    Marks,
    Wake,
    new_token,
    schema_problem,
)

__all__ = ["CHANNEL", "PostgresStore"]

log = logging.getLogger(__name__)

CHANNEL = "router_outbox"

# One round trip; router/relay/store/postgres_sql.py has the function and why each clause is there.
CLAIM = "SELECT * FROM router_claim($1, $2, $3, $4, $5, $6)"

# All outcomes of one batch in one round trip; the function is in postgres_sql.py.
MARK = "SELECT router_mark($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"

# The heartbeat of a batch still being published: fenced by the claim's token alone (rows
# another claim took over carry its token) and 'processing' (a marked row is done). The
# target and status let the planner read ix_router_outbox_stream (the rows in flight or
# waiting to retry), not the target's history. A plain statement, not a function in
# postgres_sql.py: it needs no migration.
EXTEND = """
UPDATE router_outbox SET locked_until = now() + make_interval(secs => $3)
WHERE target = $1 AND status = 'processing' AND lease_token = $2
"""

RECORD_CIRCUIT = """
INSERT INTO router_targets (target, circuit, circuit_since, circuit_worker, circuit_error)
VALUES ($1, $2, now(), $3, $4)
ON CONFLICT (target) DO UPDATE
SET circuit = EXCLUDED.circuit, circuit_since = EXCLUDED.circuit_since,
    circuit_worker = EXCLUDED.circuit_worker, circuit_error = EXCLUDED.circuit_error
"""

# Pending rows are not asked about: the claim that ran just before took every pending row it
# could, so one it left waits behind an open row of its stream (or another worker's claim),
# and becomes claimable when that row's retry or lease falls due, which this does return.
# Counting it as due now had an idle processor claim in vain every 50 ms.
NEXT_DUE = """
SELECT extract(epoch FROM least(
    (SELECT min(available_at) FROM router_outbox
     WHERE target = $1 AND status = 'failed'),
    (SELECT min(locked_until) FROM router_outbox
     WHERE target = $1 AND status = 'processing')
) - now())::float8
"""

# A dead worker's leases, fenced by its id and 'processing' (a row whose lease ran out and
# that another worker claimed since carries that worker's id): back as an untried release
# puts them, the attempt not counted. A mark the worker sent just before it died that lands
# after this is fenced by its lease token (the rows are no longer 'processing' under it); a
# claim that lands after this keeps its rows until their lease ends. Counted per target,
# for the NOTIFY that follows. A partial index of open rows serves it, never the history.
RELEASE_WORKER = """
WITH released AS (
    UPDATE router_outbox
    SET status = CASE WHEN attempts > 1 THEN 'failed' ELSE 'pending' END,
        attempts = attempts - 1, available_at = now(), locked_by = NULL, locked_until = NULL
    WHERE locked_by = $1 AND status = 'processing'
    RETURNING target
)
SELECT target, count(*) FROM released GROUP BY target
"""

_DB_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)


class PostgresStore:
    """A lazily opened asyncpg pool plus a LISTEN connection for wake-ups."""

    kind = "postgresql"

    def __init__(
        self,
        name: str,
        dsn: str,
        *,
        pool_size: int = 4,
        vacuum_after: int = 50_000,
        durable: bool = False,
    ) -> None:
        self.name = name
        self._async_commit = not durable  # see migration 0006
        self._dsn = dsn
        self._pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()
        self._vacuum_after = vacuum_after
        self._marked = 0
        self._vacuumed_at = time.monotonic()
        self._vacuum: asyncio.Task[None] | None = None

    async def claim(self, target: str, limit: int, worker: str, lease_seconds: float) -> Claim:
        """Lease up to ``limit`` due rows of ``target``, oldest first, streams in order."""
        token = new_token()
        async with self._connection() as conn:
            records = await conn.fetch(
                CLAIM, target, limit, worker, lease_seconds, token, self._async_commit
            )
        rows = [ClaimedRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6]) for r in records]
        rows.sort(key=lambda r: r.seq)  # RETURNING does not promise an order
        return Claim(token, rows)

    async def mark(self, target: str, token: int, marks: Marks) -> None:
        """One call: an UPDATE per kind of outcome, each fenced by the claim's token."""
        self._count_for_vacuum(len(marks))
        failed = [s for s, _, _ in marks.failed]
        delays = [d for _, d, _ in marks.failed]
        failed_errors = [e for _, _, e in marks.failed]
        abandoned = [s for s, _ in marks.abandoned]
        abandoned_errors = [e for _, e in marks.abandoned]
        receipts = marks.receipts
        async with self._connection() as conn:
            await conn.execute(
                MARK,
                token,
                marks.published,
                [receipts.get(seq) for seq in marks.published] if receipts else None,
                failed,
                delays,
                failed_errors,
                abandoned,
                abandoned_errors,
                marks.untried,
                self._async_commit,
            )

    async def release(self, target: str, token: int, seqs: Sequence[int]) -> None:
        """Return untried rows to the queue without counting an attempt."""
        if seqs:  # router_mark's "untried" outcome is exactly this
            await self.mark(target, token, Marks(untried=list(seqs)))

    async def extend(self, target: str, token: int, lease_seconds: float) -> int:
        """Hold the rows still under ``token`` until ``lease_seconds`` from now."""
        async with self._connection() as conn:
            status = await conn.execute(EXTEND, target, token, lease_seconds)
        return int(status.rpartition(" ")[2])  # "UPDATE <rows>"

    async def next_due(self, target: str) -> float | None:
        """Seconds until the earliest retry or lease end, from the database's clock."""
        async with self._connection() as conn:
            value = await conn.fetchval(NEXT_DUE, target)
        return None if value is None else max(0.0, float(value))

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

    async def watch(self, wake: Wake) -> None:
        """LISTEN for new rows; reconnect with backoff, and wake everyone after a gap."""
        delay = 0.5
        while True:
            try:
                conn = await asyncpg.connect(self._dsn, timeout=10)
            except _DB_ERRORS as exc:
                log.warning(
                    "db.listen.failed",
                    extra={"database": self.name, "error": _safe(exc), "retry_in": delay},
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            delay = 0.5
            closed = asyncio.Event()
            try:
                conn.add_termination_listener(lambda _conn, ev=closed: ev.set())
                await conn.add_listener(CHANNEL, lambda *args: wake(_targets(args[3])))
                log.debug("db.listen.started", extra={"database": self.name})
                wake(None)  # anything committed while we were not listening
                await closed.wait()
                log.warning("db.listen.lost", extra={"database": self.name})
            except _DB_ERRORS as exc:
                log.warning("db.listen.failed", extra={"database": self.name, "error": _safe(exc)})
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), 2)

    def _count_for_vacuum(self, rows: int) -> None:
        """Every marked row leaves dead versions in the claim index, which each claim walks
        past until VACUUM removes them. Autovacuum does that too, when it is on and gets
        there; a steady router does it itself, in the background, every so many rows."""
        if not self._vacuum_after:
            return
        self._marked += rows
        # Also on a slow trickle: a minute's worth of changes is enough to be worth it.
        due = self._marked >= self._vacuum_after or (
            self._marked >= 1000 and time.monotonic() - self._vacuumed_at > 60
        )
        if due and (self._vacuum is None or self._vacuum.done()):
            self._marked = 0
            self._vacuumed_at = time.monotonic()
            self._vacuum = asyncio.create_task(self._vacuum_now())

    async def _vacuum_now(self) -> None:
        started = time.monotonic()
        try:
            conn = await asyncpg.connect(self._dsn, timeout=10)
            try:
                await conn.execute("VACUUM (ANALYZE, SKIP_LOCKED) router_outbox")
            finally:
                await conn.close()
        except asyncpg.InsufficientPrivilegeError:
            log.warning("db.vacuum_refused", extra={"database": self.name})
            self._vacuum_after = 0  # not the table's owner: leave it to autovacuum
        except _DB_ERRORS as exc:
            log.warning("db.vacuum_failed", extra={"database": self.name, "error": _safe(exc)})
        else:
            log.info(
                "db.vacuumed",
                extra={"database": self.name, "seconds": round(time.monotonic() - started, 3)},
            )

    async def close(self) -> None:
        """Close the pool."""
        if self._vacuum is not None and not self._vacuum.done():
            self._vacuum.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._vacuum
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
        except _DB_ERRORS as exc:
            raise DatabaseError(f"{self.name}: {_safe(exc)}") from exc

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
                except _DB_ERRORS as exc:
                    raise DatabaseError(f"{self.name}: cannot connect: {_safe(exc)}") from exc
            return self._pool

    async def release_worker(self, worker: str) -> int:
        """Give back every row a dead ``worker`` holds, in one UPDATE, and NOTIFY its
        targets' processors in the same transaction (delivered at COMMIT)."""
        async with self._connection() as conn, conn.transaction():
            released = await conn.fetch(RELEASE_WORKER, worker)
            if released:
                targets = ",".join(sorted(r[0] for r in released))
                await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, targets)
        return sum(r[1] for r in released)


async def _keep_session(_connection: Any) -> None:
    """asyncpg's default reset sends a statement on every release (unlock, UNLISTEN, RESET).
    Pool connections here never change session state (the claim's locks end with its
    transaction), so an idle router can stay silent."""


def _targets(payload: str) -> set[str] | None:
    return set(payload.split(",")) if payload else None


def _safe(exc: BaseException) -> str:
    """Describe a driver error without anything from the DSN (asyncpg never puts the password
    in its messages; the type name and message are enough to act on)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
