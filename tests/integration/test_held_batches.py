"""PostgreSQL holds a batch's rows in the claim's transaction and writes each row once
(migration 0010): what that promises, against a real server."""

from __future__ import annotations

import asyncio
import json
import logging
from decimal import Decimal

import asyncpg
import pytest

from router import Outbox
from router.relay.store import BatchLost, Marks
from router.relay.store.postgres import PostgresStore
from tests.chaos.proxy import DelayingProxy
from tests.conftest import PgDatabases, make_config
from tests.integration.events import OrderPlaced

BROKERS = {"events": {"type": "memory", "internal": True}}


async def staged(url: str, streams: dict[str, int]) -> None:
    """``count`` events on each stream key, in one transaction."""
    outbox = Outbox(make_config({"main": url}, BROKERS))
    try:
        async with outbox.transaction() as tx:
            for key, count in streams.items():
                for i in range(count):
                    await tx.stage(
                        OrderPlaced(order_id=f"{key}-{i}", total=Decimal(i)), stream_key=key
                    )
    finally:
        await outbox.close()


async def rows(url: str) -> list[tuple[str, str, int]]:
    """(stream, status, attempts) of every row, in outbox order."""
    conn = await asyncpg.connect(url)
    try:
        records = await conn.fetch(
            "SELECT stream_key, status, attempts FROM router_outbox ORDER BY seq"
        )
    finally:
        await conn.close()
    return [(r[0], r[1], r[2]) for r in records]


@pytest.fixture
async def url(pg_databases: PgDatabases) -> str:
    return await pg_databases.new()


async def test_a_claim_is_busy_while_a_batch_is_in_flight_and_then_sees_its_outcome(
    url: str,
) -> None:
    await staged(url, {"A": 2, "B": 2})
    first, second = PostgresStore("main", url), PostgresStore("main", url)
    try:
        batch = await first.claim("events", 2, "w-1", 30)
        assert [r.stream_key for r in batch.rows] == ["A", "A"]
        # Batches of one target take turns: another claim answers at once, busy, without rows
        # (B's rows were free: they are not taken either).
        busy = await asyncio.wait_for(second.claim("events", 10, "w-2", 30), 2)
        assert (busy.busy, busy.rows) == (True, [])
        # A-0 fails: A-1 is held back behind it (untried), and must stay behind it.
        a0, a1 = (r.seq for r in batch.rows)
        await first.mark("events", batch.token, Marks(failed=[(a0, 60, "busy")], untried=[a1]))
        after = await second.claim("events", 10, "w-2", 30)
        assert not after.busy
        assert [r.stream_key for r in after.rows] == ["B", "B"]
        assert [r.attempts for r in after.rows] == [1, 1]  # this attempt counts
        await second.mark("events", after.token, Marks(published=[r.seq for r in after.rows]))
    finally:
        await first.close()
        await second.close()
    # One write each: A-0 failed (its attempt counted), A-1 untouched, B published.
    assert await rows(url) == [
        ("A", "failed", 1),
        ("A", "pending", 0),
        ("B", "published", 1),
        ("B", "published", 1),
    ]


async def test_a_batch_whose_connection_closes_is_queued_again_at_once(url: str) -> None:
    await staged(url, {"A": 3})
    store, other = PostgresStore("main", url), PostgresStore("main", url)
    try:
        batch = await store.claim("events", 10, "w-1", 30)
        assert len(batch) == 3
        # The worker dies: its connection goes, and PostgreSQL rolls the batch back.
        store._held[batch.token].conn.terminate()
        again = await other.claim("events", 10, "w-2", 30)
        for _ in range(50):  # the server notices the closed connection within moments
            if not again.busy:
                break
            await asyncio.sleep(0.02)
            again = await other.claim("events", 10, "w-2", 30)
        assert [r.seq for r in again.rows] == [r.seq for r in batch.rows]
        assert [r.attempts for r in again.rows] == [1, 1, 1]  # the lost attempt is not counted
        with pytest.raises(BatchLost):
            await store.mark("events", batch.token, Marks(published=[r.seq for r in batch.rows]))
        await other.mark("events", again.token, Marks(published=[r.seq for r in again.rows]))
    finally:
        await store.close()
        await other.close()
    assert await rows(url) == [("A", "published", 1)] * 3


async def test_a_silent_worker_loses_its_batch_after_its_lease_and_cannot_mark_it(url: str) -> None:
    await staged(url, {"A": 1})
    # The silent worker reaches the database through a proxy that stops passing anything, as
    # when its host is cut off or frozen (a live one says it is there every half second).
    host, port = url.split("@", 1)[1].split("/", 1)[0].split(":")
    proxy = DelayingProxy(host, int(port), 0.0)
    await proxy.start()
    via_proxy = url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}")
    silent, healthy = PostgresStore("main", via_proxy), PostgresStore("main", url)
    try:
        stale = await silent.claim("events", 10, "silent", 0.3)
        assert (await healthy.claim("events", 10, "healthy", 30)).busy
        proxy.hold()
        # Silent for longer than its lease: the server ends its session, and the batch.
        await asyncio.sleep(0.8)
        fresh = await healthy.claim("events", 10, "healthy", 30)
        assert [r.seq for r in fresh.rows] == [r.seq for r in stale.rows]
        proxy.release()
        with pytest.raises(BatchLost):
            await silent.mark(
                "events", stale.token, Marks(failed=[(stale.rows[0].seq, 60, "late")])
            )
        await healthy.mark("events", fresh.token, Marks(published=[fresh.rows[0].seq]))
    finally:
        await silent.close()
        await healthy.close()
        await proxy.stop()
    assert await rows(url) == [("A", "published", 1)]


async def test_a_live_worker_keeps_its_batch_past_the_lease_by_extending_it(url: str) -> None:
    await staged(url, {"A": 1})
    store = PostgresStore("main", url)
    try:
        batch = await store.claim("events", 10, "w-1", 0.4)
        for _ in range(4):  # waves of a long batch, each under the lease
            await asyncio.sleep(0.2)
            assert await store.extend("events", batch.token, 0.4) == 1
        await store.mark("events", batch.token, Marks(published=[batch.rows[0].seq]))
    finally:
        await store.close()
    assert await rows(url) == [("A", "published", 1)]


async def test_a_delivered_row_is_written_once(url: str) -> None:
    await staged(url, {f"s-{i}": 4 for i in range(250)})
    # Rows updated in place, and rows moved to the history by their update (migration 0011:
    # PostgreSQL counts a move as a delete from the queue slot and an insert into the history).
    stats = """
        SELECT sum(n_tup_upd) + sum(n_tup_ins) FILTER (WHERE relname = 'router_outbox_done')
        FROM pg_stat_user_tables WHERE relname LIKE 'router_outbox_%'
    """
    conn = await asyncpg.connect(url)
    try:
        before = await conn.fetchval(stats)
        store = PostgresStore("main", url)
        try:
            while (batch := await store.claim("events", 300, "w-1", 30)).rows:
                published = Marks(published=[r.seq for r in batch.rows])
                await store.mark("events", batch.token, published)
        finally:
            await store.close()  # a backend reports its counts when it exits, at the latest
        for _ in range(50):
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            if (after := await conn.fetchval(stats)) != before:
                break
            await asyncio.sleep(0.1)
    finally:
        await conn.close()
    assert await rows(url) == [(f"s-{i}", "published", 1) for i in range(250) for _ in range(4)]
    assert after - before == 1000  # one UPDATE per row: the claim wrote nothing


async def test_a_run_claims_the_next_batch_in_its_transaction_and_commits_with_its_last_mark(
    url: str,
) -> None:
    await staged(url, {"A": 3, "B": 3})
    store, other = PostgresStore("main", url), PostgresStore("main", url)
    try:
        first = await store.claim("events", 2, "w-1", 30)
        # While the first batch is published, the next is claimed in its transaction: the
        # rows after it (the first batch's own rows are locked by this very transaction).
        second = await store.claim("events", 2, "w-1", 30, after=first)
        assert [r.seq for r in second.rows] == [max(r.seq for r in first.rows) + 1, 4]
        await store.mark("events", first.token, Marks(published=[r.seq for r in first.rows]))
        # Written, not committed: nobody sees it yet, and the target is still held.
        assert [s for _, s, _ in await rows(url)] == ["pending"] * 6
        assert (await other.claim("events", 10, "w-2", 30)).busy
        third = await store.claim("events", 10, "w-1", 30, after=second)
        assert len(third) == 2
        await store.mark("events", second.token, Marks(published=[r.seq for r in second.rows]))
        await store.release("events", third.token, [r.seq for r in third.rows])  # the last
    finally:
        await store.close()
        await other.close()
    assert await rows(url) == [
        *[("A", "published", 1)] * 3,
        ("B", "published", 1),
        *[("B", "pending", 0)] * 2,
    ]


async def test_a_transaction_older_than_the_run_that_stages_behind_a_newer_one_comes_after_it(
    url: str,
) -> None:
    """A staged row carries its transaction's start time. A transaction that began before a
    run of batches and stages on a stream after one that began during the run (it waits for
    that one's commit) has the earlier time but the later place. The run's next claim used to
    find the newer row not yet due by the run's clock, and took the older one ahead of it;
    now it takes both, in their stream's order."""
    await staged(url, {"A": 2})
    outbox = Outbox(make_config({"main": url}, BROKERS))
    older = await asyncpg.connect(url)
    store = PostgresStore("main", url)
    try:
        transaction = older.transaction()
        await transaction.start()  # its time: before the run's
        await asyncio.sleep(0.01)
        first = await store.claim("events", 1, "w-1", 30)  # the run begins: A-0
        await asyncio.sleep(0.01)
        async with outbox.transaction() as tx:  # begins during the run, commits first
            await tx.stage(OrderPlaced(order_id="newer", total=Decimal(1)), stream_key="k")
        await outbox.stage(older, OrderPlaced(order_id="older", total=Decimal(2)), stream_key="k")
        await transaction.commit()
        second = await store.claim("events", 10, "w-1", 30, after=first)
        orders = [json.loads(r.envelope)["payload"]["order_id"] for r in second.rows]
        assert orders == ["A-1", "newer", "older"]
        await store.mark("events", first.token, Marks(published=[r.seq for r in first.rows]))
        await store.release("events", second.token, [r.seq for r in second.rows])
    finally:
        await store.close()
        await older.close()
        await outbox.close()


async def test_a_run_that_fails_loses_every_batch_of_it(url: str) -> None:
    await staged(url, {"A": 4})
    store = PostgresStore("main", url)
    try:
        first = await store.claim("events", 2, "w-1", 30)
        second = await store.claim("events", 2, "w-1", 30, after=first)
        await store.mark("events", first.token, Marks(published=[r.seq for r in first.rows]))
        store._held[second.token].conn.terminate()  # the session ends before the commit
        with pytest.raises(BatchLost):
            await store.mark("events", second.token, Marks(published=[r.seq for r in second.rows]))
    finally:
        await store.close()
    # The first batch's mark went with the transaction: all four are delivered again.
    assert await rows(url) == [("A", "pending", 0)] * 4


async def test_a_run_whose_session_ended_says_so_though_it_had_nothing_to_write(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A frozen host's worker wakes to find its wave unanswered (its clock ran on): every row
    # of the run goes back untried, so no mark has an outcome to write and fail on, and the
    # giving back swallows what it meets. The server ended the run's session meanwhile: the
    # worker says so, once, naming the target.
    await staged(url, {"A": 3, "B": 3})
    store = PostgresStore("main", url)
    try:
        first = await store.claim("events", 2, "w-1", 30)
        second = await store.claim("events", 2, "w-1", 30, after=first)
        killer = await asyncpg.connect(url)
        try:
            await killer.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name LIKE 'w-1%' OR (datname = current_database()"
                " AND state = 'idle in transaction' AND pid <> pg_backend_pid())"
            )
        finally:
            await killer.close()
        with caplog.at_level(logging.WARNING, logger="router.relay.store.postgres"):
            await store.mark("events", first.token, Marks(untried=[r.seq for r in first.rows]))
            await store.release("events", second.token, [r.seq for r in second.rows])
        lost = [r for r in caplog.records if r.getMessage() == "batch.session_lost"]
        assert len(lost) == 1, [r.getMessage() for r in caplog.records]
        assert (lost[0].database, lost[0].target) == ("main", "events")  # type: ignore[attr-defined]
    finally:
        await store.close()
    assert await rows(url) == [("A", "pending", 0)] * 3 + [("B", "pending", 0)] * 3
