"""Per-stream order on PostgreSQL and MariaDB: commit order per stream key, and a failing row
holds back only its own stream on its own target."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import text

from brokers import Broker, BrokerSettings, OutgoingMessage, PublishResult, create_broker
from router import Outbox
from router.config import DatabaseSettings
from tests.conftest import MysqlDatabases, NatsStreams, PgDatabases, make_config, nats_broker
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving
from tests.integration.test_write_path import Database, make_database


@pytest.fixture(params=["postgresql", "mysql"])
async def database(
    request: pytest.FixtureRequest,
    pg_databases: PgDatabases,
    mysql_databases: MysqlDatabases,
    tmp_path: Path,
) -> Database:
    """A fresh database of each kind that takes concurrent writers (not SQLite: it has one
    writer at a time, so the open transactions these tests interleave would wait on each
    other whatever their stream keys)."""
    return await make_database(request.param, pg_databases, mysql_databases, tmp_path)


def order_ids(messages: Sequence[object]) -> list[str]:
    return [json.loads(m.data)["payload"]["order_id"] for m in messages]  # type: ignore[attr-defined]


async def statuses(database: Database) -> dict[str, list[str]]:
    by_target: dict[str, list[str]] = {}
    for row in await database.fetch("SELECT target, status FROM router_outbox ORDER BY seq"):
        by_target.setdefault(row["target"], []).append(row["status"])
    return by_target


# A business table whose rows number themselves in insert order.
ORDERS = {
    "postgresql": "CREATE TABLE orders (id text PRIMARY KEY, created serial)",
    "mysql": "CREATE TABLE orders (id VARCHAR(32) PRIMARY KEY, "
    "created BIGINT NOT NULL AUTO_INCREMENT UNIQUE)",
}


async def test_two_transactions_on_one_stream_key_are_published_in_commit_order(
    database: Database, nats_streams: NatsStreams
) -> None:
    stream = nats_streams.stream("int")
    config = make_config(
        {"main": database.url},
        {"events": nats_broker(stream, internal=True)},
        base_dir=database.base_dir,
    )
    outbox = Outbox(config)
    engine = outbox.engine()
    async with engine.begin() as conn:
        await conn.execute(text(ORDERS[database.kind]))
    try:
        async with serving(config), engine.connect() as early, engine.connect() as late:
            # "early" writes its business row first but commits last...
            tx_early = await early.begin()
            await early.execute(text("INSERT INTO orders (id) VALUES ('early')"))
            # ...while "late" writes, stages and commits in between.
            async with late.begin():
                await late.execute(text("INSERT INTO orders (id) VALUES ('late')"))
                await outbox.stage(
                    late, OrderPlaced(order_id="late", total=Decimal(2)), stream_key="order-1"
                )
            await outbox.stage(
                early, OrderPlaced(order_id="early", total=Decimal(1)), stream_key="order-1"
            )
            await tx_early.commit()

            # Now the other way round: a transaction that staged first holds the stream key,
            # so one that stages on it later waits for it and commits after it.
            holder = await early.begin()
            await outbox.stage(
                early, OrderPlaced(order_id="holder", total=Decimal(3)), stream_key="order-1"
            )
            waiting = await late.begin()
            staging = asyncio.create_task(
                outbox.stage(
                    late, OrderPlaced(order_id="waiter", total=Decimal(4)), stream_key="order-1"
                )
            )
            await asyncio.sleep(0.3)
            assert not staging.done()

            # Another stream key is not held up meanwhile.
            async with outbox.transaction() as tx:
                await tx.stage(
                    OrderPlaced(order_id="other-stream", total=Decimal(5)), stream_key="order-2"
                )
            await nats_streams.messages(stream[0], 3)

            await holder.commit()
            await staging
            await waiting.commit()
            arrived = await nats_streams.messages(stream[0], 5)
            business = (await early.execute(text("SELECT id FROM orders ORDER BY created"))).all()
            await early.rollback()
    finally:
        await outbox.close()
    assert [row.id for row in business] == ["early", "late"]  # row order of the business data
    assert order_ids(arrived) == ["late", "early", "other-stream", "holder", "waiter"]


async def test_a_rolled_back_transaction_releases_the_stream(
    database: Database, nats_streams: NatsStreams
) -> None:
    stream = nats_streams.stream("int")
    config = make_config(
        {"main": database.url},
        {"events": nats_broker(stream, internal=True)},
        base_dir=database.base_dir,
    )
    outbox = Outbox(config)
    try:
        async with serving(config), outbox.engine().connect() as holder:
            tx = await holder.begin()
            await outbox.stage(
                holder, OrderPlaced(order_id="rolled-back", total=Decimal(1)), stream_key="order-1"
            )
            waiting = asyncio.create_task(_stage_in_own_transaction(outbox, "after", "order-1"))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await tx.rollback()
            await waiting
            arrived = await nats_streams.messages(stream[0], 1)
    finally:
        await outbox.close()
    assert order_ids(arrived) == ["after"]


async def _stage_in_own_transaction(outbox: Outbox, order_id: str, key: str) -> None:
    async with outbox.transaction() as tx:
        await tx.stage(OrderPlaced(order_id=order_id, total=Decimal(0)), stream_key=key)


class FailingFor:
    """The real adapter, except that chosen orders fail (retryably) until released."""

    def __init__(self, inner: Broker, failing: set[str]) -> None:
        self.inner = inner
        self.name = inner.name
        self.failing = failing

    async def connect(self) -> None:
        await self.inner.connect()

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        passing = [m for m in batch if _order(m) not in self.failing]
        results = iter(await self.inner.publish(passing) if passing else [])
        return [
            PublishResult.failed("partner is busy", retryable=True)
            if _order(m) in self.failing
            else next(results)
            for m in batch
        ]

    async def ping(self) -> None:
        await self.inner.ping()

    async def close(self) -> None:
        await self.inner.close()


def _order(message: OutgoingMessage) -> str:
    order_id: str = json.loads(message.wire.body)["payload"]["order_id"]
    return order_id


async def test_a_failing_row_holds_back_only_its_own_stream_on_its_own_target(
    database: Database, nats_streams: NatsStreams
) -> None:
    internal, partner = nats_streams.stream("int"), nats_streams.stream("ext")
    config = make_config(
        {"main": database.url},
        {"events": nats_broker(internal, internal=True), "partner": nats_broker(partner)},
        base_dir=database.base_dir,
        # Batches of two: the failing row and its successor fall in different batches (on
        # PostgreSQL, different batches of one transaction), and stay in order all the same.
        outbox={
            "batch_size": 2,
            "retry": {"base_delay": 0.2, "max_delay": 0.2, "jitter": 0, "max_attempts": 100},
        },
    )
    failing = {"a-1"}
    wrapped: dict[str, FailingFor] = {}

    def factory(name: str, settings: BrokerSettings) -> Broker:
        if name != "partner":
            return create_broker(name, settings)
        wrapped[name] = FailingFor(create_broker(name, settings), failing)
        return wrapped[name]

    outbox = Outbox(config)
    async with serving(config, broker_factory=factory):
        async with outbox.transaction() as tx:
            for i in range(3):
                await tx.stage(OrderPlaced(order_id=f"a-{i}", total=Decimal(i)), stream_key="A")
                await tx.stage(OrderPlaced(order_id=f"b-{i}", total=Decimal(i)), stream_key="B")
            await tx.stage(OrderPlaced(order_id="loose", total=Decimal(9)))

        everything = await nats_streams.messages(internal[0], 7)
        # On the partner: stream B and the keyless event flow; stream A stops at a-1.
        held = await nats_streams.messages(partner[0], 5)
        await asyncio.sleep(1.0)  # several retry rounds of a-1 while a-2 must keep waiting
        still_held = await nats_streams.messages(partner[0], 6, timeout=0.1)
        by_status = await statuses(database)

        failing.clear()  # the partner recovers: a-1, then a-2
        released = await nats_streams.messages(partner[0], 7)
    await outbox.close()

    arrived = order_ids(everything)
    assert sorted(arrived) == ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2", "loose"]
    assert [o for o in arrived if o.startswith("a")] == ["a-0", "a-1", "a-2"]
    assert [o for o in arrived if o.startswith("b")] == ["b-0", "b-1", "b-2"]
    assert sorted(order_ids(held)) == ["a-0", "b-0", "b-1", "b-2", "loose"]
    assert len(still_held) == 5
    assert by_status["events"] == ["published"] * 7
    assert sorted(by_status["partner"]) == ["failed", "pending"] + ["published"] * 5
    assert order_ids(released)[5:] == ["a-1", "a-2"]


# PostgreSQL holds a batch in its claim's transaction instead of a lease (migration 0010):
# tests/integration/test_held_batches.py has its silent worker.
@pytest.mark.parametrize("database", ["sqlite", "mysql"], indirect=True)
async def test_a_worker_whose_lease_was_taken_over_cannot_mark_the_row(
    database: Database,
) -> None:
    from router.relay.store import Marks, open_store

    config = make_config(
        {"main": database.url},
        {"events": {"type": "memory", "internal": True}},
        base_dir=database.base_dir,
    )
    outbox = Outbox(config)
    async with outbox.transaction() as tx:
        await tx.stage(OrderPlaced(order_id="o-1", total=Decimal(1)))
    await outbox.close()
    settings = DatabaseSettings.model_validate({"url": database.url})
    paused = open_store("main", settings, database.base_dir)
    healthy = open_store("main", settings, database.base_dir)
    query = "SELECT status, locked_by, attempts, last_error FROM router_outbox"
    try:
        stale = await paused.claim("events", 10, "paused-worker", 0.05)
        await asyncio.sleep(0.2)  # the paused worker's lease runs out
        fresh = await healthy.claim("events", 10, "healthy-worker", 30)
        assert [r.seq for r in fresh.rows] == [r.seq for r in stale.rows]
        # The paused worker wakes up and reports a failure: it must change nothing.
        await paused.mark("events", stale.token, Marks(failed=[(stale.rows[0].seq, 60, "late")]))
        [row] = await database.fetch(query)
        status, locked_by, attempts, last_error = row.values()
        assert (status, locked_by, attempts, last_error) == (
            "processing",
            "healthy-worker",
            2,
            None,
        )
        await healthy.mark("events", fresh.token, Marks(published=[fresh.rows[0].seq]))
        assert [r["status"] for r in await database.fetch(query)] == ["published"]
    finally:
        await paused.close()
        await healthy.close()


@pytest.mark.parametrize("durable", [False, True], ids=["default", "durable_bookkeeping"])
async def test_claims_and_marks_skip_the_wal_flush_for_their_own_transaction_only(
    pg_url: str, durable: bool
) -> None:
    # PostgreSQL only: synchronous_commit is PostgreSQL's (MySQL's flush setting is global).
    # By default the router's bookkeeping commits asynchronously (a lost claim or mark only
    # means a delivery again); with durable_bookkeeping it waits for the flush. Either way
    # the setting ends with the transaction, or a pooled session (PgBouncer) could hand it
    # on to an application's commits.
    from router.relay.store import Marks
    from router.relay.store.postgres import PostgresStore

    config = make_config({"main": pg_url}, {"events": {"type": "memory", "internal": True}})
    outbox = Outbox(config)
    async with outbox.transaction() as tx:
        await tx.stage(OrderPlaced(order_id="o-1", total=Decimal(1)))
        await tx.stage(OrderPlaced(order_id="o-2", total=Decimal(2)))
    await outbox.close()
    seen: list[str] = []

    async def note_setting(conn: asyncpg.Connection) -> None:
        seen.append(await conn.fetchval("SHOW synchronous_commit"))

    store = PostgresStore("main", pg_url, pool_size=1, durable=durable)
    conn = await asyncpg.connect(pg_url)
    try:
        async with conn.transaction():  # a batch: claim, publish, mark, commit
            [row] = await conn.fetch(
                "SELECT * FROM router_claim('events', 1, 'w', 30, $1, 0)", not durable
            )
            await note_setting(conn)
            await conn.execute(
                "SELECT router_mark($1, NULL, '{}', '{}', '{}', '{}', '{}', 'events', '{}', '{}',"
                " '{}', '{}', '{}', '{}')",
                [row["seq"]],
            )
            await note_setting(conn)
        await note_setting(conn)
        claim = await store.claim("events", 10, "w", 30)
        await store.mark("events", claim.token, Marks(published=[r.seq for r in claim.rows]))
        statuses = await conn.fetch("SELECT status FROM router_outbox")
        assert [r["status"] for r in statuses] == ["published", "published"]
    finally:
        await store.close()
        await conn.close()
    inside = "on" if durable else "off"
    assert seen == [inside, inside, "on"]
