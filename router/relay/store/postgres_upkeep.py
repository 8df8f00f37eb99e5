"""The PostgreSQL outbox's upkeep, done by the router as it marks rows: VACUUM and the ring.

Every marked row leaves a dead version in its queue slot, with its claim-index entry, which
each claim walks past until VACUUM removes it or the slot is truncated. Autovacuum may be off
or late, so a store counts the rows it marks and, in the background, on a connection of its
own (never the pool a claim may be waiting for):

- every ``vacuum_after`` rows (or after a minute with at least 1,000), VACUUMs the queue. The
  queue alone: the history only grows by inserts here, and VACUUM would read every page added
  since it last could mark them all-visible, which while the xmin horizon is held is the whole
  history written meanwhile (1.3 s a pass, and growing, within three minutes of a held run).
  The retention cleanup vacuums the history after it deletes (``router.ops.outbox``);
- every 8,192 rows (a quarter of a slot's chunk), or every 5 s while rows are marked, runs a
  pass of the ring (``postgres_ring.recycle``): finished slots are truncated.

Either job that the server refuses for want of privilege (the router does not own the table)
is not tried again: autovacuum, and VACUUM alone, are left to do it, as before 0011.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from router._schema import OUTBOX_QUEUE
from router.relay.store.base import describe_error
from router.relay.store.postgres_errors import DB_ERRORS
from router.relay.store.postgres_ring import recycle

__all__ = ["Upkeep"]

log = logging.getLogger(__name__)

_RING_EVERY_ROWS = 8192
_RING_EVERY_SECONDS = 5.0
_VACUUM_EVERY_SECONDS = 60.0
_VACUUM_AT_LEAST_ROWS = 1000


class _Job:
    """One kind of upkeep: its count of rows marked since it last ran, and its task."""

    def __init__(self, every_rows: int, every_seconds: float, at_least: int) -> None:
        self.every_rows = every_rows  # 0: never
        self.every_seconds = every_seconds
        self.at_least = at_least  # rows it takes for the time to count
        self.marked = 0
        self.at = time.monotonic()
        self.task: asyncio.Task[None] | None = None

    def due(self, rows: int) -> bool:
        """Count ``rows``; True (and the count reset) when the job should start now."""
        if not self.every_rows:
            return False
        self.marked += rows
        due = self.marked >= self.every_rows or (
            self.marked >= self.at_least and time.monotonic() - self.at > self.every_seconds
        )
        if not due or (self.task is not None and not self.task.done()):
            return False
        self.marked, self.at = 0, time.monotonic()
        return True


class Upkeep:
    """The VACUUM and ring passes of one PostgreSQL database, started as rows are marked."""

    def __init__(self, name: str, dsn: str, *, vacuum_after: int) -> None:
        self.name = name
        self._dsn = dsn
        self._vacuum = _Job(vacuum_after, _VACUUM_EVERY_SECONDS, _VACUUM_AT_LEAST_ROWS)
        self._ring = _Job(_RING_EVERY_ROWS, _RING_EVERY_SECONDS, 1)

    def marked(self, rows: int) -> None:
        """``rows`` more rows were marked: start whichever job is due, in the background."""
        if self._vacuum.due(rows):
            self._vacuum.task = asyncio.create_task(
                self._run(self._vacuum, _vacuum_queue, "db.vacuum", _report_vacuum)
            )
        if self._ring.due(rows):
            self._ring.task = asyncio.create_task(
                self._run(self._ring, recycle, "db.ring", _report_ring)
            )

    async def settled(self) -> None:
        """Wait for the jobs in flight to finish."""
        for job in (self._vacuum, self._ring):
            if job.task is not None:
                await asyncio.gather(job.task, return_exceptions=True)

    async def close(self) -> None:
        """Stop a job still running (its transaction, if any, is rolled back)."""
        for job in (self._vacuum, self._ring):
            if job.task is not None and not job.task.done():
                job.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await job.task

    async def _run(
        self,
        job: _Job,
        work: Callable[[Any], Awaitable[Any]],
        event: str,
        report: Callable[[str, Any, float], None],
    ) -> None:
        started = time.monotonic()
        try:
            conn = await asyncpg.connect(self._dsn, timeout=10)
            try:
                done = await work(conn)
            finally:
                await conn.close()
        except asyncpg.InsufficientPrivilegeError:
            log.warning(f"{event}_refused", extra={"database": self.name})
            job.every_rows = 0  # not the table's owner: not tried again
            return
        except DB_ERRORS as exc:
            log.warning(
                f"{event}_failed", extra={"database": self.name, "error": describe_error(exc)}
            )
            return
        report(self.name, done, round(time.monotonic() - started, 3))


async def _vacuum_queue(conn: Any) -> None:
    # TRUNCATE false: giving the empty tail of a slot back to the file system needs the slot
    # to itself, which a slot being filled or drained never is; VACUUM would retry for up to
    # 5 s (wait event VacuumTruncate), keeping the ring's pass off the slot all that while. The
    # ring truncates finished slots whole.
    await conn.execute(f"VACUUM (ANALYZE, SKIP_LOCKED, TRUNCATE false) {OUTBOX_QUEUE}")


def _report_vacuum(name: str, _: None, seconds: float) -> None:
    log.info("db.vacuumed", extra={"database": name, "seconds": seconds})


def _report_ring(name: str, done: Any, seconds: float) -> None:
    if done.truncated or done.kept:
        # A slot that stays kept (a paused target) would log every pass: router check
        # reports it instead.
        log.log(
            logging.INFO if done.truncated else logging.DEBUG,
            "db.ring",
            extra={
                "database": name,
                "truncated": done.truncated,
                "kept": done.kept,
                "seconds": seconds,
            },
        )
