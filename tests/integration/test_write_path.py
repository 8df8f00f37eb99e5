"""stage() against real databases: rows per target, one NOTIFY at commit, rollbacks,
rejections, autocommit refused, keyed bulk staging."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from router import Outbox, StagingError, correlation
from router.config import DatabaseSettings
from router.ops.migrate import upgrade
from tests.conftest import PgDatabases, make_config
from tests.integration.events import OrderPlaced, StockReserved

BROKERS = {
    "events": {"type": "memory", "internal": True},
    "analytics": {"type": "memory"},
    "billing": {"type": "memory", "envelope": "cloudevents"},
}


def outbox_for(url: str, **outbox: Any) -> Outbox:
    return Outbox(make_config({"main": url}, BROKERS, outbox=outbox))


@dataclass(frozen=True)
class Database:
    """A fresh, migrated outbox database of one kind, for tests that run on every kind."""

    kind: str
    url: str
    base_dir: Path

    def outbox(self) -> Outbox:
        return Outbox(make_config({"main": self.url}, BROKERS, base_dir=self.base_dir))

    async def rows(self) -> list[dict[str, Any]]:
        """Every row, in seq order, with its envelope parsed."""
        outbox = self.outbox()
        try:
            async with outbox.engine().connect() as conn:
                result = await conn.execute(
                    text(
                        "SELECT seq, target, event_type, stream_key, "
                        "CAST(envelope AS TEXT) AS envelope FROM router_outbox ORDER BY seq"
                    )
                )
                return [{**row._asdict(), "envelope": json.loads(row.envelope)} for row in result]
        finally:
            await outbox.close()


@pytest.fixture(params=["postgresql", "sqlite"])
async def database(
    request: pytest.FixtureRequest, pg_databases: PgDatabases, tmp_path: Path
) -> Database:
    """The same test on a fresh PostgreSQL database and on a fresh SQLite file (a test may
    pick the kinds with ``parametrize(..., indirect=["database"])``)."""
    if request.param == "postgresql":
        return Database("postgresql", await pg_databases.new(), tmp_path)
    url = "sqlite:///outbox.db"
    await upgrade("main", DatabaseSettings.model_validate({"url": url}), tmp_path)
    return Database("sqlite", url, tmp_path)


async def rows(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        records: list[asyncpg.Record] = await conn.fetch(
            "SELECT message_id::text, target, destination, event_type, stream_key, "
            "envelope::text, status, attempts FROM router_outbox ORDER BY seq"
        )
        return records
    finally:
        await conn.close()


async def test_published_event_makes_one_row_per_target_with_the_same_id(pg_url: str) -> None:
    outbox = outbox_for(pg_url)
    async with outbox.transaction() as tx:
        ids = await tx.stage(OrderPlaced(order_id="o-1", total=Decimal("9.50")), stream_key="o-1")
    await outbox.close()

    stored = await rows(pg_url)
    assert [r["target"] for r in stored] == ["events", "analytics", "billing"]
    assert {r["message_id"] for r in stored} == set(ids)
    assert {r["status"] for r in stored} == {"pending"}
    assert {r["stream_key"] for r in stored} == {"o-1"}
    assert [r["destination"] for r in stored] == ["order_placed"] * 3
    envelope = json.loads(stored[0]["envelope"])
    assert envelope["payload"] == {"order_id": "o-1", "total": "9.50", "note": None}
    assert envelope["type"] == "order_placed" and envelope["version"] == 2


async def test_internal_only_event_makes_one_row(pg_url: str) -> None:
    outbox = outbox_for(pg_url)
    async with outbox.transaction() as tx:
        await tx.stage(StockReserved(order_id="o-1", quantity=2))
    await outbox.close()
    assert [r["target"] for r in await rows(pg_url)] == ["events"]


async def test_rolled_back_transaction_leaves_no_row(pg_url: str) -> None:
    outbox = outbox_for(pg_url)
    with pytest.raises(RuntimeError, match="business rule"):
        async with outbox.transaction() as tx:
            await tx.stage(OrderPlaced(order_id="o-1", total=Decimal(1)))
            raise RuntimeError("business rule failed")
    await outbox.close()
    assert await rows(pg_url) == []


async def test_stage_with_an_async_session_commits_with_the_session(pg_url: str) -> None:
    outbox = outbox_for(pg_url)
    sessions = async_sessionmaker(outbox.engine(), class_=AsyncSession)
    with correlation("req-7"):
        async with sessions() as session, session.begin():
            await outbox.stage(session, StockReserved(order_id="o-2", quantity=1))
            assert await rows(pg_url) == []  # not visible before commit
    await outbox.close()
    stored = await rows(pg_url)
    assert len(stored) == 1
    assert json.loads(stored[0]["envelope"])["correlation_id"] == "req-7"


async def test_stage_with_a_raw_asyncpg_connection(pg_url: str) -> None:
    outbox = outbox_for(pg_url)
    conn = await asyncpg.connect(pg_url)
    try:
        with pytest.raises(StagingError, match="inside a transaction"):
            await outbox.stage(conn, StockReserved(order_id="o-3", quantity=1))
        async with conn.transaction():
            await outbox.stage(
                conn,
                OrderPlaced(order_id="o-3", total=Decimal(3)),
                StockReserved(order_id="o-3", quantity=1),
                stream_key="o-3",
                causation_id="cmd-1",
                headers={"tenant": "acme"},
            )
    finally:
        await conn.close()
    stored = await rows(pg_url)
    assert [r["event_type"] for r in stored] == ["order_placed"] * 3 + ["stock_reserved"]
    envelope = json.loads(stored[-1]["envelope"])
    assert envelope["causation_id"] == "cmd-1"
    assert envelope["headers"] == {"tenant": "acme"}


async def test_notify_arrives_once_and_only_at_commit(pg_url: str) -> None:
    listener = await asyncpg.connect(pg_url)
    received: list[str] = []
    await listener.add_listener("router_outbox", lambda *args: received.append(args[3]))
    outbox = outbox_for(pg_url)
    try:
        async with outbox.transaction() as tx:
            await tx.stage(
                OrderPlaced(order_id="o-4", total=Decimal(4)),
                OrderPlaced(order_id="o-5", total=Decimal(5)),
            )
            await asyncio.sleep(0.2)
            assert received == []  # nothing before COMMIT
        with pytest.raises(RuntimeError):
            async with outbox.transaction() as tx:
                await tx.stage(StockReserved(order_id="o-6", quantity=1))
                raise RuntimeError
        for _ in range(50):
            if received:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
    finally:
        await outbox.close()
        await listener.close()
    assert received == ["analytics,billing,events"]


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (OrderPlaced(order_id="x" * 400_000, total=Decimal(1)), "the limit"),
    ],
)
async def test_rejected_event_leaves_the_callers_transaction_usable(
    pg_url: str, event: OrderPlaced, message: str
) -> None:
    outbox = outbox_for(pg_url)
    async with outbox.transaction() as tx:
        with pytest.raises(StagingError, match=message):
            await tx.stage(StockReserved(order_id="ok", quantity=1), event)
        # Nothing of the rejected call was written, and the transaction goes on.
        await tx.stage(StockReserved(order_id="after", quantity=1))
    await outbox.close()
    stored = await rows(pg_url)
    assert [json.loads(r["envelope"])["payload"]["order_id"] for r in stored] == ["after"]


async def test_a_published_event_no_broker_takes_is_rejected(pg_url: str) -> None:
    config = make_config(
        {"main": pg_url},
        {"partner": {"type": "memory", "events": {"include": ["billing.*"]}}},
    )
    outbox = Outbox(config)
    async with outbox.transaction() as tx:
        with pytest.raises(StagingError, match="has no target"):
            await tx.stage(OrderPlaced(order_id="o", total=Decimal(1)))
    await outbox.close()
    assert await rows(pg_url) == []


AUTOCOMMIT = "AUTOCOMMIT"
REFUSED = (
    r"^stage\(\) needs the connection inside a transaction, but it runs in AUTOCOMMIT "
    r"\(isolation_level='AUTOCOMMIT'\), so each statement would commit on its own, apart "
    r"from the caller's work; stage on a connection without AUTOCOMMIT, in a transaction "
    r"\(async with session.begin\(\): \.\.\. or async with engine.begin\(\) as "
    r"connection: \.\.\.\)$"
)


async def stage_on_autocommit_engine(outbox: Outbox) -> None:
    async with outbox.engine(isolation_level=AUTOCOMMIT).connect() as conn:
        await outbox.stage(conn, StockReserved(order_id="o", quantity=1))


async def stage_on_autocommit_connection(outbox: Outbox) -> None:
    async with outbox.engine().connect() as conn:
        await conn.execution_options(isolation_level=AUTOCOMMIT)
        await outbox.stage(conn, StockReserved(order_id="o", quantity=1))


async def stage_on_autocommit_session(outbox: Outbox) -> None:
    bind = outbox.engine().execution_options(isolation_level=AUTOCOMMIT)
    async with AsyncSession(bind) as session, session.begin():
        await outbox.stage(session, StockReserved(order_id="o", quantity=1))


@pytest.mark.parametrize(
    "stage_in_autocommit",
    [stage_on_autocommit_engine, stage_on_autocommit_connection, stage_on_autocommit_session],
    ids=["engine", "connection", "session"],
)
async def test_stage_refuses_a_connection_in_autocommit_and_writes_nothing(
    database: Database, stage_in_autocommit: Any
) -> None:
    outbox = database.outbox()
    try:
        with pytest.raises(StagingError, match=REFUSED):
            await stage_in_autocommit(outbox)
    finally:
        await outbox.close()
    assert await database.rows() == []


async def test_a_transaction_sqlalchemy_autobegins_is_a_transaction_stage_accepts(
    database: Database,
) -> None:
    outbox = database.outbox()
    try:
        async with AsyncSession(outbox.engine()) as session:
            await outbox.stage(session, StockReserved(order_id="autobegun", quantity=1))
            await session.rollback()  # it is the caller's transaction: rolling back undoes it
            await outbox.stage(session, StockReserved(order_id="committed", quantity=1))
            await session.commit()
        async with outbox.engine().connect() as conn:
            await outbox.stage(conn, StockReserved(order_id="connection", quantity=1))
            await conn.commit()
    finally:
        await outbox.close()
    stored = await database.rows()
    assert [r["envelope"]["payload"]["order_id"] for r in stored] == ["committed", "connection"]


def key_of(i: int) -> str | None:
    """The stream key of the i-th event of the bulk tests: 97 streams, interleaved, and
    every tenth event without one."""
    return None if i % 10 == 9 else f"stream-{i % 97}"


BULK = 1000


async def bulk_via_asyncpg(outbox: Outbox, database: Database, **options: Any) -> int:
    statements: list[str] = []
    conn = await asyncpg.connect(database.url)
    conn.add_query_logger(lambda record: statements.append(record.query))
    try:
        async with conn.transaction():
            await outbox.stage(conn, *bulk_events(), **options)
    finally:
        await conn.close()
    return inserts(statements)


async def bulk_via_connection(outbox: Outbox, database: Database, **options: Any) -> int:
    async with counting(outbox) as statements, outbox.engine().begin() as conn:
        await outbox.stage(conn, *bulk_events(), **options)
    return inserts(statements)


async def bulk_via_session(outbox: Outbox, database: Database, **options: Any) -> int:
    sessions = async_sessionmaker(outbox.engine(), class_=AsyncSession)
    async with counting(outbox) as statements, sessions() as session, session.begin():
        await outbox.stage(session, *bulk_events(), **options)
    return inserts(statements)


async def bulk_via_transaction(outbox: Outbox, database: Database, **options: Any) -> int:
    async with counting(outbox) as statements, outbox.transaction() as tx:
        await tx.stage(*bulk_events(), **options)
    return inserts(statements)


def bulk_events() -> list[StockReserved]:
    return [StockReserved(order_id=f"o-{i}", quantity=i) for i in range(BULK)]


def inserts(statements: list[str]) -> int:
    return sum("INSERT INTO router_outbox" in statement for statement in statements)


@asynccontextmanager
async def counting(outbox: Outbox) -> AsyncIterator[list[str]]:
    """The statements the outbox's engine sends while the block runs."""
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    engine = outbox.engine().sync_engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", record)


@pytest.mark.parametrize(
    ("database", "stage_in_bulk"),
    [
        ("postgresql", bulk_via_asyncpg),
        ("postgresql", bulk_via_connection),
        ("postgresql", bulk_via_session),
        ("postgresql", bulk_via_transaction),
        ("sqlite", bulk_via_connection),
        ("sqlite", bulk_via_session),
        ("sqlite", bulk_via_transaction),
    ],
    indirect=["database"],
    ids=lambda value: getattr(value, "__name__", value),
)
async def test_stream_keys_stage_many_streams_in_one_insert_in_order_per_stream(
    database: Database, stage_in_bulk: Any
) -> None:
    keys = [key_of(i) for i in range(BULK)]
    outbox = database.outbox()
    try:
        statements = await stage_in_bulk(outbox, database, stream_keys=keys)
    finally:
        await outbox.close()

    stored = await database.rows()
    assert statements == 1
    assert len(stored) == BULK
    for row in stored:
        i = row["envelope"]["payload"]["quantity"]
        assert row["stream_key"] == keys[i]
        assert row["envelope"].get("stream") == keys[i]
    per_stream: dict[str | None, list[int]] = {}
    for row in stored:
        per_stream.setdefault(row["stream_key"], []).append(row["envelope"]["payload"]["quantity"])
    assert len(per_stream) == 98  # 97 streams and the events without one
    assert per_stream == {key: [i for i in range(BULK) if keys[i] == key] for key in set(keys)}


async def test_stream_keys_of_unequal_length_are_refused_and_nothing_is_written(
    database: Database,
) -> None:
    outbox = database.outbox()
    try:
        async with outbox.transaction() as tx:
            with pytest.raises(StagingError, match="stream_keys has length 2 for 3 events"):
                await tx.stage(*bulk_events()[:3], stream_keys=["a", "b"])
            with pytest.raises(StagingError, match="stream_key .* or stream_keys .*, not both"):
                await tx.stage(*bulk_events()[:2], stream_key="a", stream_keys=["a", "b"])
    finally:
        await outbox.close()
    assert await database.rows() == []


async def test_stream_keys_lock_every_stream_of_the_call_until_it_commits(pg_url: str) -> None:
    # A second transaction staging on any one of the first's streams waits for its commit,
    # so its row comes after the first's in seq order: per-stream commit order holds.
    outbox = outbox_for(pg_url)
    first, second = await asyncpg.connect(pg_url), await asyncpg.connect(pg_url)
    try:
        open_tx = first.transaction()
        await open_tx.start()
        await outbox.stage(
            first,
            *[StockReserved(order_id=f"first-{k}", quantity=1) for k in "abc"],
            stream_keys=["a", "b", "c"],
        )

        async def stage_later() -> None:
            async with second.transaction():
                await outbox.stage(
                    second, StockReserved(order_id="second-c", quantity=2), stream_key="c"
                )

        later = asyncio.create_task(stage_later())
        await asyncio.sleep(0.3)
        assert not later.done()  # waits on stream "c", taken by the first transaction
        await open_tx.commit()
        await asyncio.wait_for(later, 5)
    finally:
        await first.close()
        await second.close()
    order_ids = [json.loads(r["envelope"])["payload"]["order_id"] for r in await rows(pg_url)]
    assert order_ids == ["first-a", "first-b", "first-c", "second-c"]
