"""Gap markers in each store, on PostgreSQL, SQLite and MariaDB: abandoning a row with a
stream key records its gap, the next claim of the stream names it, a published mark that
named it deletes it, a requeue deletes the gap of the row it puts back, and cleanup the gaps
older than the abandoned rows' retention."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest

from router.config import DatabaseSettings
from router.ops.browse import message
from router.ops.migrate import migrate_to, upgrade
from router.ops.outbox import cleanup, requeue
from router.relay.store import SCHEMA_REVISION, Claim, ClaimedRow, Marks, OutboxStore, open_store
from tests.conftest import Database, make_config
from tests.integration.events import OrderPlaced

BROKERS = {"events": {"type": "memory", "internal": True}}
KEYS = ("k", "k", "k", "other")  # events 1, 2, 3 on one stream, 4 on another


async def stage(database: Database) -> list[str]:
    """Events 1 to 4 on KEYS, in one transaction; their message ids."""
    outbox = database.outbox(BROKERS)
    try:
        async with outbox.transaction() as tx:
            events = [OrderPlaced(order_id=str(n), total=Decimal(n)) for n in range(1, 5)]
            await tx.stage(*events, stream_keys=list(KEYS))
    finally:
        await outbox.close()
    return [str(row["message_id"]) for row in await database.rows()]


@contextlib.asynccontextmanager
async def opened(database: Database) -> AsyncIterator[OutboxStore]:
    config = make_config({"main": database.url}, BROKERS, base_dir=database.base_dir)
    store = open_store("main", config.databases["main"], database.base_dir)
    try:
        yield store
    finally:
        await store.close()


async def claim(store: OutboxStore) -> Claim:
    return await store.claim("events", 10, "w1", 30)


def by_order(claim: Claim) -> dict[int, ClaimedRow]:
    """The claimed rows by their event's number (1 to 4: rows are staged in that order)."""
    first = min(row.seq for row in claim.rows)
    return {row.seq - first + 1: row for row in claim.rows}


async def gaps(database: Database) -> list[dict[str, Any]]:
    rows = await database.fetch(
        "SELECT target, stream_key, seq, message_id FROM router_gaps ORDER BY seq"
    )
    return [{**row, "message_id": str(row["message_id"])} for row in rows]


async def abandon_the_second(database: Database, store: OutboxStore) -> dict[int, ClaimedRow]:
    """Claim 1 to 4; publish 1, abandon 2 and give 3 and 4 back untried."""
    first = await claim(store)
    rows = by_order(first)
    assert [row.skipped for row in rows.values()] == [(), (), (), ()]
    marks = Marks(
        published=[rows[1].seq],
        abandoned=[(rows[2].seq, "not retryable: too large")],
        untried=[rows[3].seq, rows[4].seq],
    )
    await store.mark("events", first.token, marks)
    return rows


async def test_a_published_row_that_named_a_gap_closes_it(database: Database) -> None:
    ids = await stage(database)
    async with opened(database) as store:
        rows = await abandon_the_second(database, store)
        # The abandoned row's gap, recorded with its mark.
        assert await gaps(database) == [
            {"target": "events", "stream_key": "k", "seq": rows[2].seq, "message_id": ids[1]}
        ]

        again = await claim(store)
        later = {row.seq: row for row in again.rows}
        assert sorted(later) == [rows[3].seq, rows[4].seq]
        assert later[rows[3].seq].skipped == (ids[1],)  # the next row of its stream names it
        assert later[rows[4].seq].skipped == ()  # another stream has no gap
        published = Marks(published=sorted(later), reported=[("k", ids[1])])
        await store.mark("events", again.token, published)

    assert await gaps(database) == []
    statuses = [row["status"] for row in await database.rows()]
    assert statuses == ["published", "abandoned", "published", "published"]


async def test_the_console_shows_a_row_still_to_be_sent_as_it_will_name_the_gap(
    database: Database,
) -> None:
    ids = await stage(database)
    config = make_config({"main": database.url}, BROKERS, base_dir=database.base_dir)
    async with opened(database) as store:
        await abandon_the_second(database, store)
    [third] = await message(config, ids[2])
    assert third["status"] == "pending"
    assert third["message"]["headers"]["skipped-message-ids"] == ids[1]
    assert third["message"]["body"]["skipped"] == [ids[1]]
    [other] = await message(config, ids[3])
    assert "skipped-message-ids" not in other["message"]["headers"]
    [first] = await message(config, ids[0])  # published before the gap: nothing to name
    assert "skipped" not in first["message"]["body"]


async def test_a_row_that_failed_after_naming_a_gap_leaves_it_open(database: Database) -> None:
    ids = await stage(database)
    async with opened(database) as store:
        await abandon_the_second(database, store)
        again = await claim(store)
        third = min(again.rows, key=lambda row: row.seq)
        assert third.skipped == (ids[1],)
        marks = Marks(failed=[(third.seq, 0.0, "refused")], untried=[third.seq + 1])
        await store.mark("events", again.token, marks)
        assert [gap["message_id"] for gap in await gaps(database)] == [ids[1]]
        # Retried, it names the gap again.
        retried = await claim(store)
        assert [row.skipped for row in retried.rows] == [(ids[1],), ()]
        await store.release("events", retried.token, [row.seq for row in retried.rows])


async def test_a_requeued_row_is_no_gap_any_more(database: Database) -> None:
    ids = await stage(database)
    config = make_config({"main": database.url}, BROKERS, base_dir=database.base_dir)
    async with opened(database) as store:
        rows = await abandon_the_second(database, store)
        assert len(await gaps(database)) == 1

        assert await requeue(config, targets_=["events"]) == {"main": 1}
        assert await gaps(database) == []

        again = await claim(store)
        assert sorted(row.seq for row in again.rows) == [rows[n].seq for n in (2, 3, 4)]
        assert [row.skipped for row in again.rows] == [(), (), ()]
        await store.release("events", again.token, [row.seq for row in again.rows])
    assert ids[1] in [row["message_id"] for row in await database.rows()]


async def test_cleanup_removes_gaps_past_the_abandoned_rows_retention(database: Database) -> None:
    await stage(database)
    async with opened(database) as store:
        await abandon_the_second(database, store)
    kept = make_config({"main": database.url}, BROKERS, base_dir=database.base_dir)
    [done] = await cleanup(kept)
    assert (done.abandoned, done.gaps) == (0, 0)
    assert len(await gaps(database)) == 1

    retention = {"retention": {"abandoned": timedelta(0)}}
    gone = make_config(
        {"main": database.url}, BROKERS, base_dir=database.base_dir, outbox=retention
    )
    [done] = await cleanup(gone)
    assert (done.abandoned, done.gaps) == (1, 1)
    assert await gaps(database) == []


async def test_a_row_without_a_stream_key_leaves_no_gap(database: Database) -> None:
    outbox = database.outbox(BROKERS)
    try:
        async with outbox.transaction() as tx:
            await tx.stage(OrderPlaced(order_id="1", total=Decimal(1)))
    finally:
        await outbox.close()
    async with opened(database) as store:
        claimed = await claim(store)
        [row] = claimed.rows
        await store.mark("events", claimed.token, Marks(abandoned=[(row.seq, "refused")]))
    assert await gaps(database) == []


async def test_the_gaps_table_comes_with_init_db_and_goes_with_a_downgrade(
    database: Database,
) -> None:
    settings = DatabaseSettings.model_validate({"url": database.url})
    await migrate_to("main", settings, database.base_dir, "0015")
    with pytest.raises(Exception, match="router_gaps"):
        await gaps(database)
    result = await upgrade("main", settings, database.base_dir)
    assert (result.before, result.after) == ("0015", SCHEMA_REVISION)
    assert await gaps(database) == []
    await stage(database)  # and the claim and mark work again on the upgraded schema
    async with opened(database) as store:
        await abandon_the_second(database, store)
    assert len(await gaps(database)) == 1
