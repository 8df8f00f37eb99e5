"""stage() against real PostgreSQL: rows per target, one NOTIFY at commit, rollbacks, rejections."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from router import Outbox, StagingError, correlation
from tests.conftest import make_config
from tests.integration.events import OrderPlaced, StockReserved

BROKERS = {
    "events": {"type": "memory", "internal": True},
    "analytics": {"type": "memory"},
    "billing": {"type": "memory", "envelope": "cloudevents"},
}


def outbox_for(url: str, **outbox: Any) -> Outbox:
    return Outbox(make_config({"main": url}, BROKERS, outbox=outbox))


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
