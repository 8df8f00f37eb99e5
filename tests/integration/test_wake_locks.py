"""PostgreSQL: a commit notifies only while a relay of its target is idle (it holds the
target's wake lock), through every statement form ``stage()`` sends; and a relay that waits
with ``poll_interval`` at an hour still delivers events staged from another process within
milliseconds (at random moments: tests/integration/test_wake_random.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from decimal import Decimal
from pathlib import Path

import asyncpg
import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from router import Outbox, SyncOutbox
from router._wakeup import CHANNEL, WAKE_LOCK_NAMESPACE
from router.ops.outbox import set_paused
from router.relay.store.postgres_wake import PENDING, WakeLocks
from tests.conftest import make_config
from tests.integration.events import OrderPlaced
from tests.integration.wake_relay import ONE_TARGET, Relay

TWO_TARGETS = {**ONE_TARGET, "partner": {"type": "memory"}}

Stage = Callable[[str, int, int], Awaitable[None]]
"""``stage(url, events, keys)``: commit ``events`` events on ``keys`` stream keys."""


def events(count: int, keys: int) -> tuple[list[OrderPlaced], list[str | None]]:
    return (
        [OrderPlaced(order_id=f"o-{n}", total=Decimal(n)) for n in range(count)],
        [f"k-{n % keys}" if keys else None for n in range(count)],
    )


async def stage_asyncpg(outbox: Outbox, url: str, count: int, keys: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            staged, streams = events(count, keys)
            await outbox.stage(conn, *staged, stream_keys=streams)
    finally:
        await conn.close()


async def stage_session(outbox: Outbox, url: str, count: int, keys: int) -> None:
    async with AsyncSession(outbox.engine()) as session, session.begin():
        staged, streams = events(count, keys)
        await outbox.stage(session, *staged, stream_keys=streams)


def stage_psycopg(outbox: SyncOutbox, url: str, count: int, keys: int, prepare: bool) -> None:
    with psycopg.connect(url, prepare_threshold=0 if prepare else None) as conn:
        staged, streams = events(count, keys)
        outbox.stage(conn, *staged, stream_keys=streams)


# (writer, events, stream keys): the one-event VALUES form (prepared and as a simple query),
# unnest (asyncpg, SQLAlchemy, psycopg under 64 rows) and COPY (psycopg, 64 rows or more).
FORMS = [
    ("asyncpg", 1, 1),
    ("asyncpg", 20, 5),
    ("session", 1, 0),
    ("session", 20, 5),
    ("psycopg", 1, 1),
    ("psycopg", 20, 5),
    ("psycopg", 100, 7),
    ("psycopg-simple", 1, 1),
    ("psycopg-simple", 20, 5),
]


@pytest.fixture
async def listening(pg_url: str) -> AsyncIterator[asyncio.Queue[str]]:
    """What ``router_outbox`` notifications arrive, as a relay's LISTEN connection hears."""
    heard: asyncio.Queue[str] = asyncio.Queue()
    conn = await asyncpg.connect(pg_url)
    await conn.add_listener(CHANNEL, lambda *args: heard.put_nowait(args[3]))
    yield heard
    await conn.close()


async def heard_within(heard: asyncio.Queue[str], seconds: float) -> list[str]:
    found = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            found.append(await asyncio.wait_for(heard.get(), left))
        except TimeoutError:
            break
    return found


@pytest.mark.parametrize(("writer", "count", "keys"), FORMS, ids=lambda v: str(v))
async def test_a_commit_notifies_only_while_a_relay_of_its_target_idles(
    pg_url: str,
    listening: asyncio.Queue[str],
    tmp_path: Path,
    writer: str,
    count: int,
    keys: int,
) -> None:
    config = make_config({"main": pg_url}, TWO_TARGETS, base_dir=tmp_path)
    outbox, sync = Outbox(config), SyncOutbox(config)

    async def stage() -> None:
        if writer == "asyncpg":
            await stage_asyncpg(outbox, pg_url, count, keys)
        elif writer == "session":
            await stage_session(outbox, pg_url, count, keys)
        else:
            prepare = writer == "psycopg"
            await asyncio.to_thread(stage_psycopg, sync, pg_url, count, keys, prepare)

    relay = await asyncpg.connect(pg_url)  # an idle relay's LISTEN connection
    try:
        await stage()  # no relay idles: nothing to hear
        assert await heard_within(listening, 0.3) == []
        take = "SELECT pg_advisory_lock($1, hashtext($2))"
        await relay.execute(take, WAKE_LOCK_NAMESPACE, "partner")
        await stage()  # the partner's relay idles: one notification, naming both targets
        assert await heard_within(listening, 0.5) == ["events,partner"]
        give_back = "SELECT pg_advisory_unlock($1, hashtext($2))"
        await relay.execute(give_back, WAKE_LOCK_NAMESPACE, "partner")
        await stage()
        assert await heard_within(listening, 0.3) == []
    finally:
        await relay.close()
        await outbox.close()
    assert len(await outbox_rows(pg_url)) == 3 * count * 2


async def test_a_database_waking_by_poll_never_notifies(
    pg_url: str, listening: asyncio.Queue[str], tmp_path: Path
) -> None:
    config = make_config({"main": {"url": pg_url, "wakeup": "poll"}}, ONE_TARGET, base_dir=tmp_path)
    outbox = Outbox(config)
    relay = await asyncpg.connect(pg_url)
    try:
        await relay.execute("SELECT pg_advisory_lock($1, hashtext('events'))", WAKE_LOCK_NAMESPACE)
        for count, keys in ((1, 1), (20, 5)):
            await stage_asyncpg(outbox, pg_url, count, keys)
            await stage_session(outbox, pg_url, count, keys)
        await asyncio.to_thread(stage_psycopg, SyncOutbox(config), pg_url, 100, 7, True)
        assert await heard_within(listening, 0.3) == []
    finally:
        await relay.close()
        await outbox.close()
    assert len(await outbox_rows(pg_url)) == 2 * 21 + 100


async def outbox_rows(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch("SELECT seq FROM router_outbox"))
    finally:
        await conn.close()


@pytest.fixture
async def relay(pg_url: str, tmp_path: Path) -> AsyncIterator[Relay]:
    relay = Relay(pg_url, tmp_path)
    await relay.runner.start()
    yield relay
    await relay.runner.shutdown()


async def settled_holders(url: str, target: str, expected: list[str]) -> list[str]:
    """``wake_lock_holders`` once it is ``expected``, or as it is after two seconds: a
    stager's transaction-scoped share ends with its commit, which a loaded machine may take a
    moment to finish."""
    deadline = asyncio.get_running_loop().time() + 2.0
    while (holders := await wake_lock_holders(url, target)) != expected:
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    return holders


async def wake_lock_holders(url: str, target: str) -> list[str]:
    """The modes in which sessions hold ``target``'s wake lock in the database at ``url``
    (advisory locks belong to a database, and another test's may hold its own target of the
    same name at the same time on the same server)."""
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT mode FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = $1::bigint::oid AND objid = (hashtext($2)::bigint & 4294967295)::oid "
            "AND objsubid = 2 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            WAKE_LOCK_NAMESPACE,
            target,
        )
        return [row["mode"] for row in rows]
    finally:
        await conn.close()


async def test_events_staged_elsewhere_after_idle_gaps_arrive_within_50_ms(
    relay: Relay, pg_url: str
) -> None:
    committed = await relay.stage_elsewhere([[1.0, 3.0]])
    lateness = await relay.lateness(committed)
    assert max(lateness) < 0.05, lateness
    assert await settled_holders(pg_url, "events", ["ExclusiveLock"]) == ["ExclusiveLock"]


async def test_a_paused_target_holds_no_wake_lock_so_its_stagers_never_notify(
    relay: Relay, pg_url: str, listening: asyncio.Queue[str]
) -> None:
    await relay.lateness(await relay.stage_elsewhere([[0.0]]))  # the relay works, then idles
    assert await settled_holders(pg_url, "events", ["ExclusiveLock"]) == ["ExclusiveLock"]
    await set_paused(relay.config, "events", paused=True, actor="test")
    # The pause's notification woke the relay: it gives the lock back.
    assert await settled_holders(pg_url, "events", []) == []
    while not listening.empty():
        listening.get_nowait()
    await relay.stage_elsewhere([[0.0, 0.05, 0.05]])
    assert await heard_within(listening, 0.3) == []


async def test_stagers_notify_nothing_while_the_relay_is_busy(
    pg_url: str, tmp_path: Path, listening: asyncio.Queue[str]
) -> None:
    # A backlog of small batches to a slow partner keeps the relay busy for seconds: events
    # staged meanwhile queue no NOTIFY, and the relay's claims find them all the same.
    relay = Relay(pg_url, tmp_path, batch_size=10, publish_delay=0.1)
    outbox = Outbox(relay.config)
    try:
        await stage_asyncpg(outbox, pg_url, 300, 30)
    finally:
        await outbox.close()
    while not listening.empty():
        listening.get_nowait()
    await relay.runner.start()
    try:
        await asyncio.sleep(0.3)
        committed = await relay.stage_elsewhere([[0.05] * 10])
        assert await heard_within(listening, 0.2) == []
        await relay.lateness(committed, within=10.0)
    finally:
        await relay.runner.shutdown()


async def test_a_rate_limited_relay_with_rows_waiting_holds_no_wake_lock(
    pg_url: str, tmp_path: Path, listening: asyncio.Queue[str]
) -> None:
    # Waiting for its rate limit's tokens, with rows left, a processor is not idle: were it
    # to hold its wake lock, every writer of the database would pay NOTIFY's commit lock.
    relay = Relay(pg_url, tmp_path, broker={"rate_limit": 20})
    outbox = Outbox(relay.config)
    try:
        await stage_asyncpg(outbox, pg_url, 200, 10)  # ten seconds' worth at 20/s
    finally:
        await outbox.close()
    await relay.runner.start()
    try:
        await asyncio.sleep(1.0)
        assert 0 < len(relay.arrived) < 200
        assert await wake_lock_holders(pg_url, "events") == []
        while not listening.empty():
            listening.get_nowait()
        await relay.stage_elsewhere([[0.0]])
        assert await heard_within(listening, 0.3) == []
    finally:
        await relay.runner.shutdown()


async def test_a_relay_idle_again_while_its_take_was_undone_takes_the_lock_anew(
    pg_url: str,
) -> None:
    """The race a relay under load met about once in ten runs of test_wake_random: it goes
    idle (a take starts), a commit wakes it while the take looks for rows (``busy`` gives
    back what the take just got), it claims, finds nothing, and goes idle again while the
    first take is still finishing. That take ends without the lock; the relay waited with no
    lock held, so no stager notified it, until its poll an hour later. It must take the lock
    anew, and hold it."""
    conn = await asyncpg.connect(pg_url)
    looking = asyncio.Event()
    go_on = asyncio.Event()

    class SlowLook:
        """The LISTEN connection, its look for rows held until ``go_on``."""

        async def execute(self, query: str, *args: object) -> object:
            return await conn.execute(query, *args)

        async def fetchval(self, query: str, *args: object) -> object:
            if query == PENDING:  # the take's look for rows, right after it got the lock
                looking.set()
                await go_on.wait()
            return await conn.fetchval(query, *args)

    locks = WakeLocks("main")
    woken: list[set[str] | None] = []
    locks.attach(SlowLook(), woken.append)
    try:
        await locks.idle("events")
        await asyncio.wait_for(looking.wait(), 5)
        locks.busy("events")  # woken by a commit: the lock the take got goes back
        await locks.idle("events")  # nothing to claim: idle again, the first take unfinished
        go_on.set()
        deadline = time.monotonic() + 5
        while not await holds_wake_lock(pg_url, conn, "events"):
            assert time.monotonic() < deadline, "the idle relay holds no wake lock"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # and keeps it: nothing left to undo it
        assert await holds_wake_lock(pg_url, conn, "events")
    finally:
        locks.detach()
        await conn.close()


async def holds_wake_lock(url: str, relay: asyncpg.Connection, target: str) -> bool:
    """Whether ``relay``'s session holds ``target``'s wake lock, as another session sees it."""
    other = await asyncpg.connect(url)
    try:
        pid = relay.get_server_pid()
        return bool(
            await other.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND classid = $1::oid AND objid = (hashtext($2)::bigint & 4294967295)::oid"
                " AND objsubid = 2 AND pid = $3 AND granted)",
                WAKE_LOCK_NAMESPACE,
                target,
                pid,
            )
        )
    finally:
        await other.close()
