"""The relay's half of waking on PostgreSQL without a NOTIFY on every commit.

A NOTIFY costs its transaction an instance-wide lock at COMMIT, so ``stage()`` notifies only
while a relay needs it (``router/_wakeup.py``): a processor
with nothing to claim holds its target's wake lock (a session advisory lock, exclusive) on
the store's LISTEN connection while it waits, and a stager that finds that lock taken
notifies at its commit. A processor that is woken gives its lock back, so while it works the
stagers of its target notify nothing: its next claim finds their rows.

Going idle is where a commit could be missed, so it goes:

1. the claim found nothing;
2. take the wake lock (``pg_try_advisory_lock``). A stager that tried it shared and went on
   without notifying holds its shared lock until its transaction ends, so the try fails
   while such a commit may be in flight;
3. taken: look once more (a commit just before the lock may have notified no one), then
   wait: every later stager of the target notifies. The look is ``PENDING``, a statement of
   its own after the lock (a statement sees what committed before it began), and only when
   it finds rows does the processor claim;
4. not taken, and another session holds it exclusively: another relay waits idle, and a
   stager notifies it and this one alike (a NOTIFY reaches every listener). Look again
   within ``COVERED_RECHECK``, in case that relay goes away;
5. not taken because stagers hold it shared: wait for it (``pg_advisory_lock``), at most
   ``lock_timeout`` (``WAIT``). While this waits in the lock's queue, a new stager's try
   conflicts with it and fails, so that stager notifies; those in flight end, the lock is
   taken, and it goes on as in 3. Past ``WAIT`` (stagers in a long transaction), look again
   and try anew.

A paused target holds no wake lock: its stagers need not notify (its resume does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import asyncpg

from router._schema import OUTBOX_QUEUE, TARGETS
from router._wakeup import WAKE_LOCK_NAMESPACE
from router.relay.store.base import Wake

__all__ = ["COVERED_RECHECK", "WakeLocks"]

log = logging.getLogger(__name__)

COVERED_RECHECK = 1.0
"""Seconds between tries at the wake lock while another relay holds it."""
WAIT = 0.05
"""Seconds a processor going idle waits for stagers in flight to let go of its wake lock.
The LISTEN connection hands no notification over while it waits, so it stays short."""

# One round trip: paused, taken, held by another relay (an exclusive holder), or held shared
# by stagers in flight. An advisory lock on two int4 keys shows in pg_locks as classid, objid
# (as oid, so a negative hash reads as its unsigned value) and objsubid 2.
TAKE = f"""
SELECT CASE
    WHEN EXISTS (SELECT 1 FROM {TARGETS} WHERE target = $1 AND paused) THEN 'paused'
    WHEN pg_try_advisory_lock({WAKE_LOCK_NAMESPACE}, hashtext($1)) THEN 'taken'
    WHEN EXISTS (
        SELECT 1 FROM pg_locks l JOIN pg_database d ON d.oid = l.database
        WHERE l.locktype = 'advisory' AND d.datname = current_database()
          AND l.classid = {WAKE_LOCK_NAMESPACE}::oid
          AND l.objid = (hashtext($1)::bigint & 4294967295)::oid AND l.objsubid = 2
          AND l.mode = 'ExclusiveLock' AND l.granted
    ) THEN 'covered'
    ELSE (SELECT 'taken' FROM (SELECT pg_advisory_lock({WAKE_LOCK_NAMESPACE}, hashtext($1))) AS l)
END
"""
GIVE_BACK = f"SELECT pg_advisory_unlock({WAKE_LOCK_NAMESPACE}, hashtext($1))"
# Whether the target has rows a claim could take now: what a claim would cost to learn, at the
# price of one probe of the claim index (ix_router_outbox_claim, status pending or failed).
PENDING = (
    f"SELECT EXISTS (SELECT 1 FROM {OUTBOX_QUEUE} "
    "WHERE target = $1 AND status IN ('pending', 'failed') "
    "AND (status = 'pending' OR available_at <= now()))"
)


class WakeLocks:
    """The wake locks of one database's idle processors, on its LISTEN connection.

    Going idle runs in the background: the processor starts its wait at once, so a
    notification that comes meanwhile wakes it without delay, and it is woken (``wake``)
    when the look after the lock finds rows, when stagers outlast ``WAIT``, and every
    ``COVERED_RECHECK`` while another relay holds the lock.
    """

    def __init__(self, database: str) -> None:
        self.database = database
        self._conn: Any = None  # the LISTEN connection while it is up
        self._wake: Wake | None = None
        self._held: set[str] = set()
        self._wanted: set[str] = set()  # targets whose processor waits idle: lock them
        self._queued: set[str] = set()  # a take spawned and not started yet
        self._looking: set[str] = set()  # woken to look once more: not busy for that
        self._waits_bounded: Any = None  # the connection whose lock_timeout is WAIT
        self._ops = asyncio.Lock()  # one statement at a time on the connection
        self._tasks: set[asyncio.Task[None]] = set()

    def attach(self, conn: Any, wake: Wake) -> None:
        """``conn`` listens now: idle processors take their locks on it; ``wake`` wakes the
        processors of some targets."""
        self._conn, self._wake = conn, wake
        self._reset()

    def detach(self) -> None:
        """The LISTEN connection is gone, and every lock with it."""
        self._conn = None
        self._reset()

    def _reset(self) -> None:
        """A new LISTEN connection, or none: no lock is held (``attach`` wakes everyone, and
        each processor that finds nothing says it is idle again)."""
        self._held, self._wanted, self._queued, self._looking = set(), set(), set(), set()

    async def idle(self, target: str) -> float | None:
        """``target``'s processor found nothing to claim and waits: take its wake lock, in
        the background. Always None: the processor waits for a wake-up alone.

        A take already under way may end without the lock: the processor was busy meanwhile
        (``busy`` gave back what the take had just got), and is idle again now. So a new
        take is queued behind it (and behind that give-back) unless one is queued already;
        each take checks, in its turn, that the lock is still wanted and not held."""
        self._wanted.add(target)
        if self._conn is not None and target not in self._held | self._queued:
            self._queued.add(target)
            self._spawn(self._go_idle(self._conn, target))
        return None

    async def _go_idle(self, conn: Any, target: str) -> None:
        async with self._ops:
            self._queued.discard(target)
            if conn is not self._conn or target not in self._wanted or target in self._held:
                return  # gone, woken meanwhile, or taken by an earlier take
            look = await self._take(conn, target)
        if look and self._wake is not None:
            self._looking.add(target)
            self._wake({target})

    async def _take(self, conn: Any, target: str) -> bool:
        """Take ``target``'s wake lock; whether its processor must look (again) now."""
        try:
            if self._waits_bounded is not conn:
                await conn.execute(f"SET lock_timeout = '{WAIT * 1000:.0f}ms'")
                self._waits_bounded = conn
            state = await conn.fetchval(TAKE, target)
            if state != "taken":
                if state == "covered" and self._wake is not None:
                    asyncio.get_running_loop().call_later(COVERED_RECHECK, self._wake, {target})
                return False  # covered, or paused
            self._held.add(target)
            return bool(await conn.fetchval(PENDING, target))
        except asyncpg.LockNotAvailableError:
            return True  # stagers still in flight after WAIT: look, then try anew
        except Exception as exc:  # the connection is going (a server gone mid-statement
            # leaves asyncpg's own InternalClientError): its watcher wakes everyone once back
            log.debug("wakeup.lock_failed", extra={"database": self.database, "error": str(exc)})
            return False

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def busy(self, target: str) -> None:
        """``target``'s processor is awake: give its wake lock back, in the background (a
        late give-back only means a few more notifications)."""
        if target in self._looking:  # the look once more, not new work: keep the lock
            self._looking.discard(target)
            return
        self._wanted.discard(target)
        if target not in self._held:
            return
        self._held.discard(target)
        self._spawn(self._give_back(self._conn, target))

    async def _give_back(self, conn: Any, target: str) -> None:
        async with self._ops:
            if conn is not self._conn:
                return  # that connection is gone, and the lock with it
            try:
                await conn.fetchval(GIVE_BACK, target)
            except Exception as exc:  # as in idle(): the lock goes with it
                log.debug(
                    "wakeup.unlock_failed", extra={"database": self.database, "error": str(exc)}
                )
