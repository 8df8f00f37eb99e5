"""The inbox on PostgreSQL, SQLite and MariaDB: each event's effect applied once, whatever
arrives."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
import sqlalchemy as sa
import yaml
from faststream import Context
from faststream.rabbit import ExchangeType, RabbitExchange, RabbitQueue
from faststream.rabbit import RabbitBroker as FastStreamRabbit
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from brokers import OutgoingMessage, create_broker
from envelopes import RouterError, make_internal_envelope, message_id_of, render, uuid7
from router.ops.schema import inbox as inbox_table
from router.write.inbox import Inbox, inbox_middleware
from tests.conftest import Database
from tests.contract.harnesses import RABBIT_URL
from tests.e2e.helpers import router
from tests.services import RABBITMQ, require

DAY = timedelta(days=1)


@pytest.fixture
async def engine(database: Database) -> AsyncIterator[AsyncEngine]:
    """The application's engine on a fresh database of each kind, with a payments table."""
    outbox = database.outbox()
    engine = outbox.engine()
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE payments (order_id text, amount int)"))
    yield engine
    await outbox.close()


async def payments(engine: AsyncEngine) -> list[tuple[str, int]]:
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT order_id, amount FROM payments"))).all()
    return [(r[0], r[1]) for r in rows]


def pay(order: str, amount: int) -> Any:
    async def effect(conn: AsyncConnection) -> None:
        await conn.execute(text("INSERT INTO payments VALUES (:o, :a)"), {"o": order, "a": amount})

    return effect


async def test_a_message_delivered_twice_applies_its_effect_once(engine: AsyncEngine) -> None:
    inbox = Inbox("billing")
    message_id = str(uuid7())
    assert await inbox.handle(engine, message_id, pay("o-1", 10)) is True
    assert await inbox.handle(engine, message_id, pay("o-1", 10)) is False
    assert await payments(engine) == [("o-1", 10)]
    # Another consumer of the same event has its own record.
    assert await Inbox("shipping").handle(engine, message_id, pay("o-1", 0)) is True


async def test_a_failing_handler_leaves_no_record_and_the_redelivery_applies(
    engine: AsyncEngine,
) -> None:
    inbox = Inbox("billing")
    message_id = str(uuid7())

    async def broken(conn: AsyncConnection) -> None:
        await pay("o-2", 20)(conn)
        raise RuntimeError("card declined")

    with pytest.raises(RuntimeError, match="card declined"):
        await inbox.handle(engine, message_id, broken)
    async with engine.connect() as conn:
        records = (await conn.execute(text("SELECT count(*) FROM router_inbox"))).scalar_one()
    assert records == 0
    assert await payments(engine) == []
    assert await inbox.handle(engine, message_id, pay("o-2", 20)) is True
    assert await inbox.handle(engine, message_id, pay("o-2", 20)) is False
    assert await payments(engine) == [("o-2", 20)]


async def test_two_consumers_receiving_one_message_at_once_apply_it_once(
    engine: AsyncEngine,
) -> None:
    inbox = Inbox("billing")
    message_id = str(uuid7())
    first_inside = asyncio.Event()

    async def slow(conn: AsyncConnection) -> None:
        await pay("o-3", 30)(conn)
        first_inside.set()
        await asyncio.sleep(0.5)  # still uncommitted while the second delivery arrives

    first = asyncio.create_task(inbox.handle(engine, message_id, slow))
    await first_inside.wait()
    second = asyncio.create_task(inbox.handle(engine, message_id, pay("o-3", 30)))
    results = await asyncio.gather(first, second)  # no error surfaces from the loser
    assert sorted(results) == [False, True]
    assert await payments(engine) == [("o-3", 30)]


async def test_a_message_without_an_id_is_refused(engine: AsyncEngine) -> None:
    with pytest.raises(RouterError, match="no message id"):
        await Inbox("billing").handle(engine, message_id_of(b"{}", {}), pay("x", 1))


async def test_a_faststream_subscriber_applies_a_redelivered_message_once(
    engine: AsyncEngine,
) -> None:
    require("RabbitMQ", RABBITMQ)
    tag = str(uuid7())[-8:]
    exchange, queue = f"inbox-{tag}", f"inbox-{tag}-billing"
    calls: list[str] = []
    broker = FastStreamRabbit(
        RABBIT_URL, logger=None, middlewares=[inbox_middleware(Inbox("billing"), engine)]
    )

    @broker.subscriber(
        RabbitQueue(queue, auto_delete=True, routing_key="orders.#"),
        RabbitExchange(exchange, type=ExchangeType.TOPIC, auto_delete=True),
    )
    async def on_order(
        body: dict[str, Any],
        conn: AsyncConnection = Context("inbox"),  # noqa: B008 - FastStream's injection
    ) -> None:
        calls.append(body["id"])
        payload = body["payload"]
        await pay(payload["order_id"], payload["amount"])(conn)

    settings = create_broker("partner", _rabbit_settings(exchange))
    stored = make_internal_envelope(
        message_id=str(uuid7()),
        event_type="order_paid",
        version=1,
        time=datetime.now(UTC),
        source="shop",
        payload_json=json.dumps({"order_id": "o-9", "amount": 90}).encode(),
    )
    message = OutgoingMessage("orders.paid", render(stored, "external"))
    async with broker:
        await broker.start()
        for _ in range(3):  # the relay crashed between ack and mark, twice
            assert (await settings.publish([message]))[0].ok
        await settings.close()
        for _ in range(100):
            if await payments(engine) and await _queue_empty(queue):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    assert await payments(engine) == [("o-9", 90)]
    assert calls == [message.wire.message_id]  # the duplicates never reached the handler


def _rabbit_settings(exchange: str) -> Any:
    from brokers.settings import RabbitSettings

    return RabbitSettings.model_validate(
        {
            "type": "rabbitmq",
            "url": RABBIT_URL,
            "destination": "orders.{event_type}",
            "exchange": {"name": exchange, "type": "topic", "durable": False, "declare": False},
        }
    )


async def _queue_empty(queue: str) -> bool:
    connection = await aio_pika.connect(RABBIT_URL)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return bool(declared.declaration_result.message_count == 0)


async def test_cleanup_removes_records_older_than_the_window(database: Database) -> None:
    now = datetime.now(UTC)
    await database.execute(
        sa.insert(inbox_table).values(
            [
                *(
                    {"consumer": "billing", "message_id": f"old-{i}", "received_at": now - 20 * DAY}
                    for i in range(1, 26)
                ),
                *(
                    {"consumer": "billing", "message_id": f"new-{i}", "received_at": now - DAY}
                    for i in range(1, 6)
                ),
            ]
        )
    )
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "databases": {"main": database.url},
                "brokers": {"events": {"type": "memory", "internal": True}},
                "outbox": {"retention": {"inbox": "14d", "batch_size": 10}},
            }
        )
    )
    result = router("cleanup", "--json", cwd=database.base_dir)
    assert json.loads(result.stdout)["databases"][0]["inbox"] == 25
    left = await database.execute(
        sa.select(inbox_table.c.message_id).order_by(inbox_table.c.message_id)
    )
    assert [r["message_id"] for r in left] == [f"new-{i}" for i in range(1, 6)]
