"""Per-stream order on PostgreSQL: commit order per stream key, and a failing row holds back
only its own stream on its own target."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from decimal import Decimal

import asyncpg

from brokers import Broker, BrokerSettings, OutgoingMessage, PublishResult, create_broker
from router import Outbox
from tests.conftest import NatsStreams, make_config, nats_broker
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving, statuses


def order_ids(messages: Sequence[object]) -> list[str]:
    return [json.loads(m.data)["payload"]["order_id"] for m in messages]  # type: ignore[attr-defined]


async def test_staging_on_one_stream_key_waits_for_the_open_transaction_and_order_follows_commits(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    stream = nats_streams.stream("int")
    config = make_config({"main": pg_url}, {"events": nats_broker(stream, internal=True)})
    outbox = Outbox(config)
    first = await asyncpg.connect(pg_url)
    second = await asyncpg.connect(pg_url)
    try:
        async with serving(config):
            # "second" begins first and stages first, but commits last.
            tx_second = second.transaction()
            await tx_second.start()
            await outbox.stage(
                second, OrderPlaced(order_id="staged-first", total=Decimal(1)), stream_key="order-1"
            )

            tx_first = first.transaction()
            await tx_first.start()
            staging = asyncio.create_task(
                outbox.stage(
                    first,
                    OrderPlaced(order_id="staged-second", total=Decimal(2)),
                    stream_key="order-1",
                )
            )
            await asyncio.sleep(0.3)
            assert not staging.done()  # waits: an open transaction holds stream "order-1"

            # Another stream key is not held up by it.
            async with outbox.transaction() as tx:
                await tx.stage(
                    OrderPlaced(order_id="other-stream", total=Decimal(3)), stream_key="order-2"
                )
            assert order_ids(await nats_streams.messages(stream[0], 1)) == ["other-stream"]

            await tx_second.commit()
            await staging
            await tx_first.commit()
            arrived = await nats_streams.messages(stream[0], 3)
    finally:
        await first.close()
        await second.close()
        await outbox.close()
    assert order_ids(arrived) == ["other-stream", "staged-first", "staged-second"]


async def test_a_rolled_back_transaction_releases_the_stream(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    stream = nats_streams.stream("int")
    config = make_config({"main": pg_url}, {"events": nats_broker(stream, internal=True)})
    outbox = Outbox(config)
    holder = await asyncpg.connect(pg_url)
    try:
        async with serving(config):
            tx = holder.transaction()
            await tx.start()
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
        await holder.close()
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
    pg_url: str, nats_streams: NatsStreams
) -> None:
    internal, partner = nats_streams.stream("int"), nats_streams.stream("ext")
    config = make_config(
        {"main": pg_url},
        {"events": nats_broker(internal, internal=True), "partner": nats_broker(partner)},
        outbox={"retry": {"base_delay": 0.2, "max_delay": 0.2, "jitter": 0, "max_attempts": 100}},
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
        by_status = await statuses(pg_url)

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
