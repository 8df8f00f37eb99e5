"""router serve's processors against real PostgreSQL and NATS JetStream.

Asserts what arrived at the broker and what the outbox table says afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from decimal import Decimal
from typing import Any

from brokers import Broker, BrokerSettings, OutgoingMessage, PublishResult, create_broker
from envelopes import EXTERNAL_FIELDS, ExternalEnvelope, InternalEnvelope
from router import Outbox, RouterConfig, Runner
from tests.conftest import NatsStreams, make_config, nats_broker, pg_fetch
from tests.integration.events import OrderPlaced, StockReserved
from tests.services import free_port


@contextlib.asynccontextmanager
async def serving(config: RouterConfig, **kwargs: Any) -> AsyncIterator[Runner]:
    supervisor = Runner(config, **kwargs)
    await supervisor.start()
    try:
        yield supervisor
    finally:
        await supervisor.shutdown()


async def statuses(url: str) -> dict[str, list[str]]:
    records = await pg_fetch(url, "SELECT target, status FROM router_outbox ORDER BY seq")
    by_target: dict[str, list[str]] = {}
    for record in records:
        by_target.setdefault(record["target"], []).append(record["status"])
    return by_target


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def test_internal_gets_full_envelope_and_partners_the_stripped_one(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    internal, partner_a, partner_b = (nats_streams.stream(n) for n in ("int", "pa", "pb"))
    # Partners get staged headers and extensions only when their allow-list names them.
    shared = {"headers": ["channel"], "extensions": ["region"]}
    config = make_config(
        {"main": pg_url},
        {
            "events": nats_broker(internal, internal=True),
            "analytics": nats_broker(partner_a, expose=shared),
            "billing": nats_broker(partner_b, omit=["causation_id"], expose=shared),
        },
    )
    outbox = Outbox(config)
    async with outbox.transaction() as tx:
        [message_id] = await tx.stage(
            OrderPlaced(order_id="o-1", total=Decimal("12.30")),
            stream_key="o-1",
            correlation_id="corr-1",
            causation_id="cause-1",
            headers={"channel": "web"},
            extensions={"region": "eu"},
            tenant="acme",
            traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            expected_version=4,
            priority=5,
            positions={"global": 10, "stream": 4},
        )
        await tx.stage(StockReserved(order_id="o-1", quantity=1), stream_key="o-1")
    await outbox.close()

    async with serving(config):
        [full, reserved] = await nats_streams.messages(internal[0], 2)
        [stripped_a] = await nats_streams.messages(partner_a[0], 1)
        [stripped_b] = await nats_streams.messages(partner_b[0], 1)

    body = json.loads(full.data)
    InternalEnvelope.model_validate(body)
    assert body["id"] == message_id
    assert body["type"] == "order_placed" and body["version"] == 2
    assert body["source"] == "shop" and body["stream"] == "o-1"
    assert body["correlation_id"] == "corr-1" and body["causation_id"] == "cause-1"
    assert body["expected_version"] == 4 and body["priority"] == 5
    assert body["positions"] == {"global": 10, "stream": 4}
    assert body["tenant"] == "acme" and body["asynchronous"] is True
    assert body["headers"] == {"channel": "web"} and body["extensions"] == {"region": "eu"}
    assert body["checksum"].startswith("sha256:") and len(body["checksum"]) == 71
    assert body["event_class"] == "tests.integration.events.OrderPlaced"
    assert isinstance(body["sequence"], int)
    assert body["payload"] == {"order_id": "o-1", "total": "12.30", "note": None}
    assert full.subject == internal[1] + ".order_placed"
    assert json.loads(reserved.data)["type"] == "stock_reserved"

    external = json.loads(stripped_a.data)
    ExternalEnvelope.model_validate(external)
    assert set(external) == set(EXTERNAL_FIELDS)
    for field in (
        "id",
        "type",
        "version",
        "time",
        "source",
        "stream",
        "correlation_id",
        "causation_id",
        "traceparent",
        "extensions",
    ):
        assert external[field] == body[field], field
    assert external["payload"] == body["payload"]  # user nulls in the payload stay
    assert stripped_a.subject == partner_a[1] + ".order_placed"
    assert set(json.loads(stripped_b.data)) == set(EXTERNAL_FIELDS) - {"causation_id"}

    for message in (full, stripped_a, stripped_b):
        assert message.headers["Nats-Msg-Id"] == message_id
        assert message.headers["message-id"] == message_id
        assert message.headers["event-type"] == "order_placed"
        assert message.headers["correlation-id"] == "corr-1"
        assert message.headers["channel"] == "web"
    assert await statuses(pg_url) == {
        "events": ["published", "published"],
        "analytics": ["published"],
        "billing": ["published"],
    }


class Recording:
    """A real adapter, wrapped to note when each message's attempts started and ended."""

    def __init__(self, inner: Broker) -> None:
        self.inner = inner
        self.name = inner.name
        self.attempts: dict[str, list[tuple[float, float]]] = {}

    async def connect(self) -> None:
        # The adapter connects inside publish instead, so that a failed connect is timed as
        # the attempt of the batch it held up.
        return

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        started = time.monotonic()
        try:
            return await self.inner.publish(batch)
        finally:
            ended = time.monotonic()
            for message in batch:
                self.attempts.setdefault(message.wire.message_id, []).append((started, ended))

    async def ping(self) -> None:
        await self.inner.ping()

    async def close(self) -> None:
        await self.inner.close()


async def test_an_unreachable_partner_spends_no_attempt_while_others_deliver(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    # Unreachable is no verdict on the rows: the first publish finds it so, gives its rows
    # back untried and opens the partner's circuit; probes follow, not attempts. (A broker's
    # refusal is what rows retry on: tests/unit/test_processor.py.)
    internal, partner = nats_streams.stream("int"), nats_streams.stream("down")
    retry = {"max_attempts": 4, "base_delay": 0.3, "max_delay": 0.8, "jitter": 0.25}
    config = make_config(
        {"main": pg_url},
        {
            "events": nats_broker(internal, internal=True),
            "partner": nats_broker(
                partner, url=f"nats://127.0.0.1:{free_port()}", connect_timeout=0.5
            ),
        },
        outbox={"retry": retry, "poll_interval": 30, "circuit": {"probe_max_delay": 0.5}},
    )
    recorders: dict[str, Recording] = {}

    def factory(name: str, settings: BrokerSettings) -> Broker:
        recorders[name] = Recording(create_broker(name, settings))
        return recorders[name]

    outbox = Outbox(config)
    async with serving(config, broker_factory=factory) as supervisor:
        async with outbox.transaction() as tx:
            await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(5)))
        delivered = await nats_streams.messages(internal[0], 5)
        # Far longer than all four attempts' back-off would take (0.3 + 0.6 + 0.8 s).
        await asyncio.sleep(3.0)
        circuit = supervisor.processor("main", "partner").circuit
        assert circuit.is_open
        assert "cannot connect" in (circuit.reason or "")
    await outbox.close()

    assert len(delivered) == 5
    assert (await statuses(pg_url))["events"] == ["published"] * 5
    assert {len(a) for a in recorders["partner"].attempts.values()} == {1}  # then probes only
    rows = await pg_fetch(
        pg_url, "SELECT status, attempts, last_error FROM router_outbox WHERE target = 'partner'"
    )
    assert [(r["status"], r["attempts"], r["last_error"]) for r in rows] == [
        ("pending", 0, None)
    ] * 5


async def test_a_partner_that_never_answers_does_not_slow_the_others(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    hung: list[asyncio.StreamWriter] = []

    async def accept_and_say_nothing(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)

    server = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    internal, partner = nats_streams.stream("int"), nats_streams.stream("hang")
    config = make_config(
        {"main": pg_url},
        {
            "events": nats_broker(internal, internal=True),
            "partner": nats_broker(
                partner, url=f"nats://127.0.0.1:{port}", connect_timeout=5, publish_timeout=5
            ),
        },
    )
    outbox = Outbox(config)
    latencies = []
    try:
        async with serving(config):
            for i in range(20):
                started = time.monotonic()
                async with outbox.transaction() as tx:
                    await tx.stage(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)))
                await nats_streams.messages(internal[0], i + 1, timeout=5)
                latencies.append(time.monotonic() - started)
            assert len(hung) >= 1  # the partner's processor is stuck connecting meanwhile
            partner_rows = (await statuses(pg_url))["partner"]
    finally:
        await outbox.close()
        server.close()
        for writer in hung:
            writer.close()
    assert max(latencies) < 0.5, latencies
    assert "published" not in partner_rows


async def test_a_rolled_back_transaction_publishes_nothing(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    internal, partner = nats_streams.stream("int"), nats_streams.stream("ext")
    config = make_config(
        {"main": pg_url},
        {"events": nats_broker(internal, internal=True), "partner": nats_broker(partner)},
    )
    outbox = Outbox(config)
    async with serving(config):
        with contextlib.suppress(RuntimeError):
            async with outbox.transaction() as tx:
                await tx.stage(OrderPlaced(order_id="rolled-back", total=Decimal(1)))
                raise RuntimeError("payment declined")
        async with outbox.transaction() as tx:
            [committed] = await tx.stage(OrderPlaced(order_id="committed", total=Decimal(2)))
        internal_messages = await nats_streams.messages(internal[0], 1)
        partner_messages = await nats_streams.messages(partner[0], 1)
        await asyncio.sleep(0.5)  # a wrong delivery of the rolled-back event would show now
        internal_messages = await nats_streams.messages(internal[0], 2, timeout=0.1)
    await outbox.close()
    assert [m.headers["Nats-Msg-Id"] for m in internal_messages] == [committed]
    assert [m.headers["Nats-Msg-Id"] for m in partner_messages] == [committed]
    assert await statuses(pg_url) == {"events": ["published"], "partner": ["published"]}
