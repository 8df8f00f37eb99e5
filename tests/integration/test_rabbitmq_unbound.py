"""A RabbitMQ partner whose queue is not bound yet, against the real RabbitMQ: the broker
returns the message (NO_ROUTE, published ``mandatory``), which is no verdict on it. The row
waits to be retried, saying what to bind; once the partner binds its queue, the next attempt
delivers it, with no ``router requeue``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from router import Outbox
from router.ops.schema import outbox as outbox_table
from tests.conftest import Database, make_config
from tests.contract.harnesses import RabbitHarness
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving
from tests.services import RABBITMQ, require

# Retried every 0.3 s: the test binds the queue after a few attempts.
RETRY = {"max_attempts": 50, "base_delay": 0.3, "max_delay": 0.3, "jitter": 0}


@pytest.fixture
async def rabbit() -> AsyncIterator[RabbitHarness]:
    require("RabbitMQ", RABBITMQ)
    harness = RabbitHarness()
    try:
        yield harness
    finally:
        await harness.cleanup()


async def partner_row(database: Database) -> dict[str, Any]:
    """The partner's one row: status, attempts, last_error."""
    o = outbox_table
    rows = await database.execute(
        sa.select(o.c.status, o.c.attempts, o.c.last_error).where(o.c.target == "partner")
    )
    assert len(rows) == 1, rows
    return rows[0]


async def until_row(database: Database, wanted: Any, timeout: float = 15) -> dict[str, Any]:
    """The partner's row once ``wanted(row)`` holds."""
    deadline = time.monotonic() + timeout
    while not wanted(row := await partner_row(database)):
        assert time.monotonic() < deadline, row
        await asyncio.sleep(0.05)
    return row


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
async def test_an_unbound_queue_is_retried_and_delivered_once_bound(
    database: Database, rabbit: RabbitHarness
) -> None:
    brokers = {"events": {"type": "memory", "internal": True}, "partner": rabbit.config()}
    config = make_config(
        {"main": database.url}, brokers, database.base_dir, outbox={"retry": RETRY}
    )
    destination = rabbit.destination("order_placed")
    outbox = Outbox(config)
    async with serving(config):
        try:
            async with outbox.transaction() as tx:
                [message_id] = await tx.stage(OrderPlaced(order_id="o-1", total=Decimal(1)))
        finally:
            await outbox.close()

        # Nothing bound: tried, refused, and waiting to be tried again (not abandoned).
        failed = await until_row(database, lambda r: r["attempts"] >= 2)
        assert failed["status"] in ("failed", "processing"), failed
        assert failed["last_error"] == (
            f"unroutable: no queue bound to exchange {rabbit.exchange!r} with routing key "
            f"{destination!r} (NO_ROUTE); bind one (the partner's queue), or change the "
            "destination; retried until max_attempts"
        )

        await rabbit.prepare(destination)  # the partner binds its queue
        published = await until_row(database, lambda r: r["status"] == "published")
    assert published["attempts"] > failed["attempts"]
    arrived = await rabbit.arrived(destination, 1)
    assert [a.native_id for a in arrived] == [message_id]
