"""PostgreSQL's partitioned outbox (migration 0011): finished queue slots are truncated, even
while a snapshot holds the xmin horizon; a slot still in use keeps its rows; no insert ever
lacks a partition; the migration keeps every row, both ways."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal
from pathlib import Path

import asyncpg
import pytest

from router import Outbox
from router.config import DatabaseSettings
from router.ops.migrate import migrate_to, upgrade
from router.ops.pg_health import postgres_warnings
from router.relay.store import SCHEMA_REVISION, Marks
from router.relay.store.postgres import PostgresStore
from router.relay.store.postgres_ring import recycle, slot_of
from router.relay.store.postgres_sql import RING_CHUNK_BITS
from router.relay.store.postgres_upkeep import Upkeep
from tests.conftest import PgDatabases, make_config
from tests.integration.events import OrderPlaced

BROKERS = {"events": {"type": "memory", "internal": True}}
CHUNK = 1 << RING_CHUNK_BITS


@pytest.fixture
async def url(pg_databases: PgDatabases) -> str:
    return await pg_databases.new()


async def stage_at(url: str, first_seq: int, count: int, key: str = "k") -> list[int]:
    """``count`` events staged from seq ``first_seq`` on (the sequence moved there first)."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SELECT setval('router_outbox_seq_seq', $1, false)", first_seq)
    finally:
        await conn.close()
    outbox = Outbox(make_config({"main": url}, BROKERS))
    try:
        async with outbox.transaction() as tx:
            for i in range(count):
                await tx.stage(OrderPlaced(order_id=f"{key}-{i}", total=Decimal(i)), stream_key=key)
    finally:
        await outbox.close()
    return list(range(first_seq, first_seq + count))


async def publish_all(url: str) -> int:
    """Claim and publish every queued row through the store, as the router does."""
    store = PostgresStore("main", url)
    published = 0
    try:
        while True:
            claim = await store.claim("events", 500, "w-1", 30)
            if not claim.rows:
                return published
            await store.mark("events", claim.token, Marks(published=[r.seq for r in claim.rows]))
            published += len(claim.rows)
    finally:
        await store.close()


async def query(url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def finish_slot_0(url: str) -> None:
    """Slot 0 holds 10 published rows, and new rows have moved on to slot 3."""
    await stage_at(url, 1, 10)
    await publish_all(url)
    await stage_at(url, 3 * CHUNK, 1)


async def pass_over(url: str, **options: float) -> tuple[list[int], dict[int, str]]:
    conn = await asyncpg.connect(url)
    try:
        done = await recycle(conn, **options)
    finally:
        await conn.close()
    return done.truncated, done.kept


async def sizes(url: str) -> dict[int, int]:
    records = await query(
        url,
        "SELECT s, pg_relation_size('router_outbox_q' || s) FROM generate_series(0, 7) s",
    )
    return {r[0]: r[1] for r in records}


async def test_rows_live_in_the_slot_of_their_chunk_until_finished_then_in_the_history(
    url: str,
) -> None:
    seqs = await stage_at(url, 1, 3) + await stage_at(url, 3 * CHUNK + 5, 2)
    assert [slot_of(s) for s in seqs] == [0, 0, 0, 3, 3]
    await publish_all(url)
    await stage_at(url, 9 * CHUNK, 1)  # the ring wraps: slot 1 again, beside nothing
    found = await query(
        url, "SELECT seq, tableoid::regclass::text, status FROM router_outbox ORDER BY seq"
    )
    assert [(r[0], r[1], r[2]) for r in found] == [
        *((s, "router_outbox_done", "published") for s in seqs),
        (9 * CHUNK, "router_outbox_q1", "pending"),
    ]


async def test_a_finished_slot_is_truncated_while_a_snapshot_holds_the_xmin_horizon(
    url: str,
) -> None:
    holder = await asyncpg.connect(url)
    try:
        # A report in a repeatable-read transaction: VACUUM could remove nothing from now on.
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await holder.fetchval("SELECT count(*) FROM router_audit")
        await stage_at(url, 1, 200)  # slot 0
        await stage_at(url, CHUNK + 1, 5, key="stuck")  # slot 1: stays queued
        assert await publish_all(url) == 205
        await query(url, "UPDATE router_outbox SET status = 'pending' WHERE stream_key = 'stuck'")
        await stage_at(url, 4 * CHUNK, 1, key="new")  # new rows go to slot 4
        before = await sizes(url)
        assert before[0] > 0 and before[1] > 0
        await query(url, "VACUUM router_outbox_q0")
        dead = await query(
            url, "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'router_outbox_q0'"
        )
        assert dead[0][0] == 200  # VACUUM could not remove them

        truncated, kept = await pass_over(url)

        assert truncated == [0]
        assert kept == {1: "holds unfinished rows"}
        after = await sizes(url)
        assert after[0] == 0 and after[1] == before[1]
    finally:
        await holder.close()
    counted = await query(
        url, "SELECT status, count(*) FROM router_outbox GROUP BY status ORDER BY status"
    )
    assert [(r[0], r[1]) for r in counted] == [("pending", 6), ("published", 200)]
    gate = await query(url, "SELECT gate_until FROM router_ring")
    assert gate[0][0] is None  # open again


async def test_the_slots_that_new_rows_go_to_are_never_truncated(url: str) -> None:
    await stage_at(url, 1, 10)
    await publish_all(url)
    # Slot 0 is finished, but the newest seq is in it: the next rows go there too.
    assert await pass_over(url) == ([], {})
    await stage_at(url, 7 * CHUNK, 1)  # slot 7; slot 0 comes next
    await publish_all(url)
    assert await pass_over(url) == ([], {})
    await stage_at(url, 9 * CHUNK, 1)  # slot 1: slots 0 and 7 are behind the newest seq
    truncated, _ = await pass_over(url)
    assert truncated == [0, 7]


async def test_a_slot_an_old_transaction_holds_waits_for_a_later_pass(url: str) -> None:
    await finish_slot_0(url)
    reader = await asyncpg.connect(url)
    try:
        await reader.execute("BEGIN")
        await reader.fetchval("SELECT count(*) FROM router_outbox_q0")
        await asyncio.sleep(0.3)
        assert await pass_over(url, busy_after=0.2) == ([], {0: "in use by a transaction open 0 s"})
        # A young one: the gate closes, and the lock is not granted in time.
        assert await pass_over(url, busy_after=30, lock_timeout=0.2) == (
            [],
            {0: "still in use when the gate closed"},
        )
    finally:
        await reader.close()
    assert (await query(url, "SELECT gate_until FROM router_ring"))[0][0] is None
    assert await pass_over(url) == ([0], {})


async def test_a_slot_being_vacuumed_waits_for_a_later_pass_without_waiting_for_it(
    url: str,
) -> None:
    await finish_slot_0(url)
    vacuum = await asyncpg.connect(url)
    try:
        await vacuum.execute("BEGIN")
        # The lock VACUUM and ANALYZE hold on a table while they work on it.
        await vacuum.execute("LOCK TABLE router_outbox_q0 IN SHARE UPDATE EXCLUSIVE MODE")
        started = time.monotonic()
        assert await pass_over(url, busy_after=30, lock_timeout=5) == (
            [],
            {0: "being vacuumed or analyzed"},
        )
        # Kept at once: no TRUNCATE waited for the lock, holding claims behind it.
        assert time.monotonic() - started < 1
    finally:
        await vacuum.close()
    assert await pass_over(url) == ([0], {})


async def test_the_routers_vacuum_leaves_a_slots_empty_pages_to_the_ring(url: str) -> None:
    await stage_at(url, 1, 500)
    await publish_all(url)  # slot 0: 500 dead versions, and new rows still go there
    size = "SELECT pg_relation_size('router_outbox_q0')"
    before = (await query(url, size))[0][0]
    assert before > 0
    upkeep = Upkeep("main", url, vacuum_after=1)
    try:
        upkeep.marked(1)
        await upkeep.settled()
    finally:
        await upkeep.close()
    vacuumed = "SELECT last_vacuum IS NOT NULL FROM pg_stat_user_tables"
    assert (await query(url, vacuumed + " WHERE relname = 'router_outbox_q0'"))[0][0]
    # Its VACUUM gave no pages back: that needs the slot to itself, which a slot in use never
    # is. A plain VACUUM does give them back.
    assert (await query(url, size))[0][0] == before
    await query(url, "VACUUM router_outbox_q0")
    assert (await query(url, size))[0][0] < before


async def test_claims_are_busy_while_the_gate_is_shut_and_a_run_ends_at_it(url: str) -> None:
    await stage_at(url, 1, 20)
    store = PostgresStore("main", url)
    try:
        first = await store.claim("events", 10, "w-1", 30)
        await query(url, "UPDATE router_ring SET gate_until = clock_timestamp() + interval '1 h'")
        # The run's next claim meets the gate: busy, and the run commits with its last mark.
        following = await store.claim("events", 10, "w-1", 30, after=first)
        assert (following.busy, following.rows) == (True, [])
        await store.mark("events", first.token, Marks(published=[r.seq for r in first.rows]))
        fresh = await store.claim("events", 10, "w-1", 30)
        assert (fresh.busy, fresh.rows) == (True, [])
        # A gate whose pass died lapses by itself.
        await query(url, "UPDATE router_ring SET gate_until = clock_timestamp() - interval '1 s'")
        again = await store.claim("events", 10, "w-1", 30)
        assert [r.seq for r in again.rows] == list(range(11, 21))
        await store.release("events", again.token, [r.seq for r in again.rows])
    finally:
        await store.close()
    published = await query(url, "SELECT count(*) FROM router_outbox WHERE status = 'published'")
    assert published[0][0] == 10


async def test_the_migration_moves_every_row_in_and_back_out(
    pg_databases: PgDatabases,
) -> None:
    url = await pg_databases.new(migrated=False)
    settings = DatabaseSettings.model_validate({"url": url})
    await _migrate(url, "0010")
    await stage_at(url, 1, 3)
    await stage_at(url, 2 * CHUNK, 2, key="later")
    await query(
        url,
        "UPDATE router_outbox SET status = 'published', published_at = now(), attempts = 1,"
        " receipt = '{\"seq\": 1}' WHERE seq = 1",
    )
    await query(
        url,
        "UPDATE router_outbox SET status = 'failed', attempts = 2, last_error = 'nope'"
        " WHERE seq = 2",
    )
    columns = "seq, message_id, target, status, attempts, last_error, receipt, envelope::text"
    before = await query(url, f"SELECT {columns} FROM router_outbox ORDER BY seq")

    result = await upgrade("main", settings, Path.cwd())
    assert (result.before, result.after) == ("0010", SCHEMA_REVISION)
    claim = await query(url, "SELECT pg_get_functiondef('router_claim'::regproc)")
    # 0012: the stream check is a row comparison only the stream index can serve.
    assert "(p.target, p.stream_key, p.seq) < (o.target, o.stream_key, o.seq)" in claim[0][0]
    # 0013: and it runs only while some stream of the target is held back.
    assert "NOT v_held_back OR o.stream_key IS NULL" in claim[0][0]
    assert await query(url, f"SELECT {columns} FROM router_outbox ORDER BY seq") == before
    where = await query(url, "SELECT seq, tableoid::regclass::text FROM router_outbox ORDER BY 1")
    assert [r[1] for r in where] == [
        "router_outbox_done",
        "router_outbox_q0",
        "router_outbox_q0",
        "router_outbox_q2",
        "router_outbox_q2",
    ]
    fresh = await stage_at_next(url)
    assert fresh == 2 * CHUNK + 2  # the sequence goes on where it was

    await _migrate(url, "0010")
    after = await query(url, f"SELECT {columns} FROM router_outbox ORDER BY seq")
    assert after[:5] == before and after[5][0] == 2 * CHUNK + 2
    kinds = await query(url, "SELECT relkind::text FROM pg_class WHERE relname = 'router_outbox'")
    assert kinds[0][0] == "r"  # a plain table again
    assert await stage_at_next(url) == 2 * CHUNK + 3


async def stage_at_next(url: str) -> int:
    outbox = Outbox(make_config({"main": url}, BROKERS))
    try:
        async with outbox.transaction() as tx:
            await tx.stage(OrderPlaced(order_id="next", total=Decimal(1)))
    finally:
        await outbox.close()
    found = await query(url, "SELECT max(seq) FROM router_outbox")
    return int(found[0][0])


async def _migrate(url: str, revision: str) -> None:
    await migrate_to("main", DatabaseSettings.model_validate({"url": url}), Path.cwd(), revision)


async def test_router_check_names_a_slot_that_unfinished_rows_keep_from_truncation(
    url: str,
) -> None:
    await stage_at(url, 1, 2)  # slot 0: left queued
    await stage_at(url, 3 * CHUNK, 1, key="later")  # new rows have moved on to slot 3
    await query(url, "UPDATE router_outbox SET created_at = now() - interval '2 h' WHERE seq < 3")
    warnings = await postgres_warnings(url, ["events"], xmin_limit=3600)
    assert warnings == [
        "queue slot router_outbox_q0 is not truncated: 2 row(s) of 'events' unfinished there "
        "for 120 min (a paused target, or rows failing); its dead rows wait for VACUUM meanwhile"
    ]
    assert await postgres_warnings(url, ["events"], xmin_limit=3 * 3600) == []


async def test_marking_rows_starts_the_vacuum_and_the_ring_pass_when_due(url: str) -> None:
    await stage_at(url, 1, 30)  # slot 0, finished below
    assert await publish_all(url) == 30
    await stage_at(url, 4 * CHUNK, 1, key="new")  # new rows go to slot 4
    vacuumed = (
        "SELECT count(*) FROM pg_stat_user_tables"
        " WHERE relname LIKE 'router_outbox_q_' AND last_vacuum IS NOT NULL"
    )
    # TRUNCATE gives the slot a new file; VACUUM keeps it.
    filenode = "SELECT pg_relation_filenode('router_outbox_q0')"
    first = (await query(url, filenode))[0][0]
    ring = Upkeep("main", url, vacuum_after=0)  # 0: no VACUUM from the router
    try:
        ring.marked(8191)
        await ring.settled()
        assert (await query(url, filenode))[0][0] == first  # within 5 s: 8,192 rows
        ring.marked(1)
        await ring.settled()
        assert (await query(url, filenode))[0][0] != first  # slot 0 truncated
        assert (await query(url, vacuumed))[0][0] == 0
    finally:
        await ring.close()
    vacuum = Upkeep("main", url, vacuum_after=100)
    try:
        vacuum.marked(99)
        await vacuum.settled()
        assert (await query(url, vacuumed))[0][0] == 0
        vacuum.marked(1)  # the 100th row: VACUUM of the queue, every slot
        await vacuum.settled()
        assert (await query(url, vacuumed))[0][0] == 8
    finally:
        await vacuum.close()
    assert (await query(url, "SELECT count(*) FROM router_outbox_done"))[0][0] == 30
