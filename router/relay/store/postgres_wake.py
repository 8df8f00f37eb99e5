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
   wait: every later stager of the target notifies;
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
from typing import Any

import asyncpg

from router._wakeup import WAKE_LOCK_NAMESPACE

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
    WHEN EXISTS (SELECT 1 FROM router_targets WHERE target = $1 AND paused) THEN 'paused'
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


class WakeLocks:
    """The wake locks of one database's idle processors, on its LISTEN connection."""

    def __init__(self, database: str) -> None:
        self.database = database
        self._conn: Any = None  # the LISTEN connection while it is up
        self._held: set[str] = set()
        self._waits_bounded: Any = None  # the connection whose lock_timeout is WAIT
        self._ops = asyncio.Lock()  # one statement at a time on the connection
        self._giving_back: set[asyncio.Task[None]] = set()

    def attach(self, conn: Any) -> None:
        """``conn`` listens now: idle processors take their locks on it."""
        self._conn, self._held = conn, set()

    def detach(self) -> None:
        """The LISTEN connection is gone, and every lock with it."""
        self._conn, self._held = None, set()

    async def idle(self, target: str) -> float | None:
        """``target``'s processor found nothing to claim: seconds within which it must look
        again (0: at once), or None to wait for a wake-up alone."""
        conn = self._conn
        if conn is None or target in self._held:
            return None
        async with self._ops:
            if conn is not self._conn:
                return None
            try:
                if self._waits_bounded is not conn:
                    await conn.execute(f"SET lock_timeout = '{WAIT * 1000:.0f}ms'")
                    self._waits_bounded = conn
                state = await conn.fetchval(TAKE, target)
            except asyncpg.LockNotAvailableError:
                return 0.0  # stagers still in flight after WAIT: look again, then try anew
            except Exception as exc:  # the connection is going (a server gone
                # mid-statement leaves asyncpg's own InternalClientError): its watcher wakes
                # everyone once it is back
                log.debug(
                    "wakeup.lock_failed", extra={"database": self.database, "error": str(exc)}
                )
                return None
        if state == "taken":
            self._held.add(target)
            return 0.0
        if state == "covered":
            return COVERED_RECHECK
        return None  # paused

    def busy(self, target: str) -> None:
        """``target``'s processor is awake: give its wake lock back, in the background (a
        late give-back only means a few more notifications)."""
        if target not in self._held:
            return
        self._held.discard(target)
        task = asyncio.create_task(self._give_back(self._conn, target))
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

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
