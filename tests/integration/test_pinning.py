"""A partner pinned to an older version of an event gets it downcast, over real PostgreSQL,
NATS JetStream and Redis Streams, while the internal broker gets the version staged."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import cast

import pytest
import redis.asyncio as aioredis

from envelopes import StagingError
from router import Event, Outbox
from tests.conftest import NatsStreams, make_config, nats_broker, pg_fetch
from tests.integration.test_delivery import serving
from tests.services import REDIS, require

REDIS_URL = "redis://127.0.0.1:6379/0"


class InvoicedV1(Event, type="test.pinned.invoiced", version=1, published=True):
    invoice_id: str
    amount: str


class Invoiced(Event, type="test.pinned.invoiced", version=2, published=True):
    invoice_id: str
    amount_cents: int
    currency: str


@Invoiced.downcaster(to=1)
def _to_v1(event: Invoiced) -> InvoicedV1:
    if event.currency == "XXX":
        raise ValueError("no v1 form for currency XXX")
    return InvoicedV1(invoice_id=event.invoice_id, amount=f"{event.amount_cents / 100:.2f}")


class Unpinnable(Event, type="test.pinned.unpinnable", version=2, published=True):
    invoice_id: str


async def redis_entries(stream: str, count: int, timeout: float = 10) -> list[dict[str, str]]:
    client = aioredis.from_url(REDIS_URL, decode_responses=True)
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            entries = cast(list[tuple[str, dict[str, str]]], await client.xrange(stream))
            if len(entries) >= count or asyncio.get_running_loop().time() > deadline:
                return [fields for _, fields in entries]
            await asyncio.sleep(0.05)
    finally:
        await client.delete(stream)
        await client.aclose()


async def test_a_pinned_partner_gets_v1_while_the_internal_broker_gets_v2(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    require("Redis", REDIS)
    internal, partner = nats_streams.stream("int"), nats_streams.stream("partner")
    redis_stream = f"t{uuid.uuid4().hex[:8]}.invoiced"
    config = make_config(
        {"main": pg_url},
        {
            "events": nats_broker(internal, internal=True),
            "billing": nats_broker(partner, versions={"test.pinned.invoiced": 1}),
            "ledger": {
                "type": "redis",
                "url": REDIS_URL,
                "destination": redis_stream,
                "versions": {"test.pinned.invoiced": 1},
            },
        },
    )
    outbox = Outbox(config)
    async with outbox.transaction() as tx:
        [message_id] = await tx.stage(
            Invoiced(invoice_id="i-1", amount_cents=1250, currency="EUR"), stream_key="i-1"
        )
    await outbox.close()

    async with serving(config):
        [current] = await nats_streams.messages(internal[0], 1)
        [pinned] = await nats_streams.messages(partner[0], 1)
        [entry] = await redis_entries(redis_stream, 1)

    full = json.loads(current.data)
    assert (full["version"], full["payload"]) == (
        2,
        {"invoice_id": "i-1", "amount_cents": 1250, "currency": "EUR"},
    )
    for body, headers in (
        (json.loads(pinned.data), pinned.headers),
        (json.loads(entry["body"]), entry),
    ):
        assert body["id"] == message_id
        assert (body["version"], body["payload"]) == (1, {"invoice_id": "i-1", "amount": "12.50"})
        assert headers["event-version"] == "1"


async def test_a_downcaster_that_raises_fails_that_row_alone(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    internal, partner = nats_streams.stream("int"), nats_streams.stream("partner")
    config = make_config(
        {"main": pg_url},
        {
            "events": nats_broker(internal, internal=True),
            "billing": nats_broker(partner, versions={"test.pinned.invoiced": 1}),
        },
    )
    outbox = Outbox(config)
    async with outbox.transaction() as tx:
        await tx.stage(Invoiced(invoice_id="bad", amount_cents=1, currency="XXX"), stream_key="a")
        await tx.stage(Invoiced(invoice_id="good", amount_cents=2, currency="EUR"), stream_key="b")
    await outbox.close()

    async with serving(config):
        [good] = await nats_streams.messages(partner[0], 1)
        await nats_streams.messages(internal[0], 2)
        await asyncio.sleep(0.3)

    assert json.loads(good.data)["payload"]["invoice_id"] == "good"
    rows = await pg_fetch(
        pg_url,
        "SELECT target, stream_key, status, last_error FROM router_outbox ORDER BY seq",
    )
    assert [(r["target"], r["stream_key"], r["status"], r["last_error"]) for r in rows] == [
        ("events", "a", "published", None),
        ("billing", "a", "failed", "cannot downcast: no v1 form for currency XXX"),
        ("events", "b", "published", None),
        ("billing", "b", "published", None),
    ]


async def test_staging_refuses_an_event_no_downcaster_brings_to_the_pin(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    internal, partner = nats_streams.stream("int"), nats_streams.stream("partner")
    config = make_config(
        {"main": pg_url},
        {
            "events": nats_broker(internal, internal=True),
            "billing": nats_broker(partner, versions={"test.pinned.unpinnable": 1}),
        },
    )
    outbox = Outbox(config)
    with pytest.raises(StagingError) as refused:
        async with outbox.transaction() as tx:
            await tx.stage(Unpinnable(invoice_id="i-1"))
    await outbox.close()

    assert str(refused.value) == (
        "event 'test.pinned.unpinnable' version 2 cannot go to broker 'billing', pinned to "
        "version 1: declare a downcaster (@Unpinnable.downcaster(to=1))"
    )
    assert await pg_fetch(pg_url, "SELECT 1 FROM router_outbox") == []
