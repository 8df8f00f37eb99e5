"""``release_worker``: on SQLite and MariaDB a dead worker's leases are given back at once,
fenced by its id, and the rows are claimable again at once, their attempt not counted. On
PostgreSQL a batch dies with its worker's connection (tests/integration/test_held_batches.py):
releasing wakes the database's processors, so an idle one takes the rows at once."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import asyncpg
import pytest

from router.relay.store import Marks, OutboxStore, open_store
from router.relay.store.postgres import CHANNEL
from tests.integration.events import OrderPlaced
from tests.integration.test_write_path import Database, database  # noqa: F401 (fixture)

BROKERS = {"events": {"type": "memory", "internal": True}, "partner": {"type": "memory"}}
DEAD, ALIVE = "host:w0:101:dead00", "host:w1:102:alive0"


def store_of(database: Database) -> OutboxStore:  # noqa: F811
    config = database.outbox(BROKERS).config
    return open_store("main", config.databases["main"], config.base_dir)


async def stage(database: Database, count: int) -> None:  # noqa: F811
    outbox = database.outbox(BROKERS)
    async with outbox.transaction() as tx:
        await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(count)))
    await outbox.close()


async def table(database: Database) -> dict[tuple[str, int], tuple[str, int, str | None]]:  # noqa: F811
    rows = await database.fetch(
        "SELECT target, seq, status, attempts, locked_by FROM router_outbox ORDER BY seq"
    )
    return {(r["target"], r["seq"]): (r["status"], r["attempts"], r["locked_by"]) for r in rows}


LEASED = pytest.mark.parametrize("database", ["sqlite", "mysql"], indirect=True)


@LEASED
async def test_a_dead_workers_rows_come_back_at_once_and_no_one_elses(
    database: Database,  # noqa: F811
) -> None:
    await stage(database, 6)
    store = store_of(database)
    try:
        # events: the dead worker's first claim fails one row (retried), then it claims again;
        # partner: three rows held by the dead worker, three by a live one.
        first = await store.claim("events", 1, DEAD, 30)
        await store.mark("events", first.token, Marks(failed=[(first.rows[0].seq, 0.0, "boom")]))
        dead_events = await store.claim("events", 6, DEAD, 30)
        dead_partner = await store.claim("partner", 3, DEAD, 30)
        alive_partner = await store.claim("partner", 3, ALIVE, 30)
        assert (len(dead_events), len(dead_partner), len(alive_partner)) == (6, 3, 3)

        assert await store.release_worker(DEAD) == 9
        after = await table(database)
        retried = ("events", first.rows[0].seq)
        assert after[retried] == ("failed", 1, None)  # its earlier attempt still counts
        for row in dead_events.rows[1:]:
            assert after[("events", row.seq)] == ("pending", 0, None)
        for row in dead_partner.rows:
            assert after[("partner", row.seq)] == ("pending", 0, None)
        for row in alive_partner.rows:
            assert after[("partner", row.seq)] == ("processing", 1, ALIVE)

        # Claimable now, by anyone, in order; a second release finds nothing.
        again = await store.claim("events", 10, ALIVE, 30)
        assert [r.seq for r in again.rows] == [r.seq for r in dead_events.rows]
        assert [r.attempts for r in again.rows] == [2, 1, 1, 1, 1, 1]
        assert [r.seq for r in (await store.claim("partner", 10, ALIVE, 30)).rows] == [
            r.seq for r in dead_partner.rows
        ]
        assert await store.release_worker(DEAD) == 0
    finally:
        await store.close()


@LEASED
async def test_a_late_mark_of_the_dead_worker_changes_nothing(
    database: Database,  # noqa: F811
) -> None:
    # A mark the worker sent just before it died may reach the database after the release:
    # the lease token fences it, whether the row waits or another worker holds it now.
    await stage(database, 2)
    store = store_of(database)
    try:
        dead = await store.claim("events", 2, DEAD, 30)
        assert await store.release_worker(DEAD) == 2
        alive = await store.claim("events", 1, ALIVE, 30)
        await store.mark("events", dead.token, Marks(published=[r.seq for r in dead.rows]))
        after = await table(database)
        assert after[("events", alive.rows[0].seq)] == ("processing", 1, ALIVE)
        assert after[("events", dead.rows[1].seq)] == ("pending", 0, None)
    finally:
        await store.close()


@pytest.mark.parametrize("database", ["postgresql"], indirect=["database"])
async def test_postgresql_wakes_every_processor_when_a_worker_died(
    database: Database,  # noqa: F811
) -> None:
    await stage(database, 2)
    store, dying = store_of(database), store_of(database)
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(database.url)
    try:
        claim = await dying.claim("partner", 2, DEAD, 30)
        await dying.close()  # the worker's process is gone, and its connections with it
        await listener.add_listener(CHANNEL, lambda *args: heard.put_nowait(args[3]))
        assert await store.release_worker(DEAD) == 0  # nothing of it is left to give back
        assert await asyncio.wait_for(heard.get(), 2) == ""  # every target of the database
        again = await store.claim("partner", 10, ALIVE, 30)
        assert [r.seq for r in again.rows] == [r.seq for r in claim.rows]
        assert [r.attempts for r in again.rows] == [1, 1]
    finally:
        await listener.close()
        await store.close()


@pytest.mark.parametrize("database", ["sqlite"], indirect=["database"])
async def test_sqlite_watchers_of_other_processes_see_the_release(
    database: Database,  # noqa: F811
) -> None:
    await stage(database, 2)
    store, other = store_of(database), store_of(database)
    woken = asyncio.Event()
    try:
        await store.claim("events", 2, DEAD, 30)
        watcher = asyncio.create_task(other.watch(lambda _targets: woken.set()))
        await asyncio.wait_for(woken.wait(), 2)  # the first look always wakes
        woken.clear()
        await asyncio.sleep(0.2)
        assert not woken.is_set()
        assert await store.release_worker(DEAD) == 2
        await asyncio.wait_for(woken.wait(), 1)
        watcher.cancel()
    finally:
        await store.close()
        await other.close()
