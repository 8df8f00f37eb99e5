"""The PostgreSQL queue's ring: finished slots are truncated, not left to VACUUM.

Unfinished rows live in ``router_outbox_queue``, in 8 slots by their seq's chunk (migration
0011: ``router_outbox_q0`` to ``router_outbox_q7``, chunks of 32,768 seqs in turn); marking a
row published or abandoned moves it to ``router_outbox_done``, and leaves its queued version
behind, dead, with its claim-index entry. VACUUM removes those only when no snapshot older
than them is left in the database: a transaction held open for ten minutes keeps ten minutes
of them, and every claim reads past them. A slot whose rows have all moved out holds nothing
but such versions, and ``TRUNCATE`` empties it whatever the xmin horizon.

A pass (``recycle``) truncates every slot that

- new rows are not going to: neither the slot of the newest seq nor the one after it;
- holds no live row (checked again under the lock, so a row that came in meanwhile, such as
  a replayed one, keeps its slot);
- no transaction older than ``busy_after`` holds a lock on (an application transaction that
  wrote a row there long ago, a report reading it): such a slot waits for a later pass;
- no VACUUM or ANALYZE (the router's own, autovacuum's, an operator's) is working on: it holds
  its lock until it is done, and a ``TRUNCATE`` waiting behind it would queue every claim,
  mark and application insert of the slot behind itself until ``lock_timeout`` (measured: a
  VACUUM's tail truncation retried for 2 s while 100,000 rows drained, and the drain lost a
  third of its rate).

``TRUNCATE`` needs the slot to itself, and every claim of a run holds its slots until the run
commits. The pass therefore shuts the claims' gate first (``router_ring.gate_until``, which
``router_claim()`` reads): claims answer busy, runs end with the batch they are publishing,
and the lock is granted within a batch; ``lock_timeout`` bounds the wait, and the gate lapses
by itself if the pass dies. One pass runs at a time across every router of the database (an
advisory lock); each slot is truncated in a transaction of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from router._schema import OUTBOX_SEQ, QUEUE_SLOT_PREFIX, RING, queue_slot
from router._wakeup import CHANNEL
from router.relay.store.postgres_sql import RING_CHUNK_BITS, RING_SLOTS

__all__ = [
    "RING_LOCK",
    "HeldSlot",
    "Recycled",
    "SlotState",
    "held_slots",
    "recycle",
    "slot_of",
    "slot_states",
]

log = logging.getLogger(__name__)

RING_LOCK = (1869903204, 0)
"""The advisory lock of a pass: a namespace of its own (claims use 1869903203, stagers
1869903202)."""

# The newest seq handed out (by any session): new rows go to its slot, or the next.
HEAD = f"SELECT last_value FROM {OUTBOX_SEQ}"

# Per slot, from one look at its locks: bytes on disk (0: empty since its last truncation),
# how long the oldest transaction holding a lock on it has been open, and whether a VACUUM or
# ANALYZE is working on it (the SHARE UPDATE EXCLUSIVE lock they hold; pg_locks shows every
# session's locks, where pg_stat_progress_vacuum hides autovacuum's table from a role without
# pg_read_all_stats).
STATE = f"""
SELECT s.slot, pg_relation_size(c.oid) AS bytes, locks.held_for, locks.maintained
FROM generate_series(0, $1 - 1) AS s(slot)
JOIN pg_class c ON c.relname = '{QUEUE_SLOT_PREFIX}' || s.slot
                AND c.relnamespace = current_schema()::regnamespace
CROSS JOIN LATERAL (
    SELECT extract(epoch FROM clock_timestamp() - min(a.xact_start))::float8 AS held_for,
           coalesce(bool_or(l.granted AND l.mode = 'ShareUpdateExclusiveLock'), false)
               AS maintained
    FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'relation' AND l.relation = c.oid AND l.pid <> pg_backend_pid()
) AS locks
ORDER BY s.slot
"""

GATE = f"UPDATE {RING} SET gate_until = clock_timestamp() + make_interval(secs => $1) WHERE id"
OPEN_GATE = f"UPDATE {RING} SET gate_until = NULL WHERE id"


def slot_of(seq: int) -> int:
    """The queue slot a row of this seq is in while unfinished."""
    return (seq >> RING_CHUNK_BITS) & (RING_SLOTS - 1)


@dataclass(frozen=True)
class SlotState:
    """One queue slot, as ``router status`` and ``router check`` show it."""

    slot: int
    bytes: int
    held_for: float | None  # seconds the oldest transaction with a lock on it has been open
    maintained: bool  # a VACUUM or ANALYZE is working on it


@dataclass
class Recycled:
    """What one pass did."""

    truncated: list[int] = field(default_factory=list)
    kept: dict[int, str] = field(default_factory=dict)  # slot: why it was left as it was
    skipped: str | None = None  # the pass did nothing at all, and why


async def slot_states(conn: Any) -> list[SlotState]:
    return [SlotState(r[0], r[1], r[2], r[3]) for r in await conn.fetch(STATE, RING_SLOTS)]


@dataclass(frozen=True)
class HeldSlot:
    """A slot new rows have left, kept from truncation by unfinished rows."""

    slot: int
    rows: int
    targets: list[str]
    age: float  # seconds since the oldest of them was staged


async def held_slots(conn: Any, older_than: float) -> list[HeldSlot]:
    """The slots out of new rows' way whose unfinished rows are older than ``older_than``."""
    head = await conn.fetchval(HEAD)
    held = []
    for state in await slot_states(conn):
        if state.slot in _filling(head) or state.bytes == 0:
            continue
        row = await conn.fetchrow(
            f"SELECT count(*), array_agg(DISTINCT target ORDER BY target),"
            f" extract(epoch FROM now() - min(created_at))::float8"
            f" FROM {queue_slot(state.slot)}"
        )
        if row[0] and row[2] > older_than:
            held.append(HeldSlot(state.slot, row[0], list(row[1]), row[2]))
    return held


def _filling(head: int) -> set[int]:
    """The slot of the newest seq and the next one: where new rows are going."""
    return {slot_of(head), slot_of(head + (1 << RING_CHUNK_BITS))}


async def recycle(
    conn: Any,
    *,
    gate_seconds: float = 3.0,
    lock_timeout: float = 0.5,
    busy_after: float = 1.0,
) -> Recycled:
    """One pass over the ring on ``conn`` (a connection of its own, outside any transaction)."""
    done = Recycled()
    if not await conn.fetchval("SELECT pg_try_advisory_lock($1, $2)", *RING_LOCK):
        done.skipped = "another router is recycling"
        return done
    try:
        filling = _filling(await conn.fetchval(HEAD))
        candidates = []
        for state in await slot_states(conn):
            if state.slot in filling or state.bytes == 0:
                continue
            if state.maintained:
                done.kept[state.slot] = "being vacuumed or analyzed"
            elif state.held_for is not None and state.held_for > busy_after:
                done.kept[state.slot] = f"in use by a transaction open {state.held_for:.0f} s"
            elif await _has_rows(conn, state.slot):
                done.kept[state.slot] = "holds unfinished rows"
            else:
                candidates.append(state.slot)
        if not candidates:
            return done
        await conn.execute(GATE, gate_seconds)
        try:
            for slot in candidates:
                await _truncate(conn, slot, lock_timeout, done)
        finally:
            await conn.execute(OPEN_GATE)
            # Wake every processor that backed off from the gate.
            await conn.execute(f"SELECT pg_notify('{CHANNEL}', '')")
        return done
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1, $2)", *RING_LOCK)


async def _has_rows(conn: Any, slot: int) -> bool:
    # A sequential scan of the slot: its index holds no entry of some live rows ('processing').
    return bool(await conn.fetchval(f"SELECT EXISTS (SELECT 1 FROM {queue_slot(slot)})"))


async def _truncate(conn: Any, slot: int, lock_timeout: float, done: Recycled) -> None:
    table = queue_slot(slot)
    try:
        async with conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = {max(1, round(lock_timeout * 1000))}")
            await conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            if await _has_rows(conn, slot):  # a row came in since the look before the gate
                done.kept[slot] = "holds unfinished rows"
                return
            await conn.execute(f"TRUNCATE {table}")
    except asyncpg.LockNotAvailableError:
        done.kept[slot] = "still in use when the gate closed"
        return
    done.truncated.append(slot)
