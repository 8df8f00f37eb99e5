"""The broker contract, written once and run against every adapter over a real peer:
NATS JetStream, Kafka (tansu), RabbitMQ, Redis Streams and Azure Service Bus (the AMQP 1.0
peer driven by the unchanged azure-servicebus SDK).

A test that says its messages arrive once reads them with ``harness.arrived_once`` and
publishes through ``harness.broker``: with ``CONTRACT_DELIVER_TWICE=1`` each of them must
fail (tests/contract/harnesses.py)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from brokers import Broker, BrokerSettings, OutgoingMessage, create_broker
from envelopes import BrokerUnavailable, PublishError, make_internal_envelope, render, uuid7
from tests.contract.harnesses import Harness


def message(
    settings: BrokerSettings, destination: str, n: int, *, stream: str | None, size: int = 0
) -> OutgoingMessage:
    stored = make_internal_envelope(
        message_id=str(uuid7()),
        event_type="order_placed",
        version=2,
        time=datetime.now(UTC),
        source="shop",
        payload_json=orjson.dumps({"n": n, "pad": "x" * size}),
        stream=stream,
        correlation_id=f"corr-{n}",
        causation_id="cause",
        headers={"channel": "web"},
        extensions={"region": "eu"},
    )
    wire = render(
        stored,
        settings.profile,
        sequence=n,
        omit=settings.omit,
        cloudevents_prefix=settings.binary_prefix,
        exposure=settings.exposure,
    )
    return OutgoingMessage(destination, wire)


async def publish(broker: Broker, batch: list[OutgoingMessage]) -> list[Any]:
    try:
        return await broker.publish(batch)
    finally:
        await broker.close()


# Partners get staged headers and extensions only when their allow-list names them.
SHARED = {"headers": ["channel"], "extensions": ["region"]}
PROFILES = [
    pytest.param({"envelope": "internal"}, id="internal"),
    pytest.param({"envelope": "external", "expose": SHARED}, id="external"),
    pytest.param({"envelope": "cloudevents", "expose": SHARED}, id="cloudevents-structured"),
    pytest.param(
        {"envelope": "cloudevents", "cloudevents_mode": "binary", "expose": SHARED},
        id="cloudevents-binary",
    ),
]


@pytest.mark.parametrize("profile", PROFILES)
async def test_a_batch_arrives_complete_and_once_with_identity_headers_and_body(
    harness: Harness, profile: dict[str, Any]
) -> None:
    settings = harness.settings(**profile)
    destination = harness.destination()
    await harness.prepare(destination)
    batch = [message(settings, destination, n, stream=f"order-{n % 2}") for n in range(6)]
    results = await publish(harness.broker("partner", settings), batch)
    assert [r.ok for r in results] == [True] * 6

    arrived = await harness.arrived_once(destination, 6)
    assert len(arrived) == 6
    by_id = {a.headers["message-id"]: a for a in arrived}
    for sent in batch:
        got = by_id[sent.wire.message_id]
        assert got.body == sent.wire.body
        assert got.headers["event-type"] == "order_placed"
        assert got.headers["correlation-id"] == sent.wire.correlation_id
        assert got.headers["channel"] == "web"
        if harness.kind != "redis":  # Redis Streams has no message id of its own
            assert got.native_id == sent.wire.message_id, harness.native_dedup
        if harness.kind in ("kafka", "servicebus"):
            assert got.key == sent.wire.stream_key  # partition key / session id
    first = by_id[batch[0].wire.message_id]
    mode = profile.get("cloudevents_mode", "structured")
    if profile["envelope"] == "cloudevents" and mode == "binary":
        prefix = settings.cloudevents_prefix
        assert json.loads(first.body) == {"n": 0, "pad": ""}
        assert first.headers[prefix + "id"] == batch[0].wire.message_id
        assert first.headers[prefix + "type"] == "order_placed"
        assert first.headers[prefix + "specversion"] == "1.0"
        assert first.headers[prefix + "region"] == "eu"
    elif profile["envelope"] == "cloudevents":
        assert json.loads(first.body)["specversion"] == "1.0"
    else:
        assert json.loads(first.body)["id"] == batch[0].wire.message_id


async def test_each_acknowledged_message_has_the_brokers_receipt(harness: Harness) -> None:
    """The receipt names where the message landed, as the broker holds it: read back with the
    broker's own client at that position. RabbitMQ's confirm names no position, only a time;
    Service Bus's SDK returns nothing, so there is no receipt."""
    settings = harness.settings()
    destination = harness.destination("receipts")
    await harness.prepare(destination)
    batch = [message(settings, destination, n, stream=f"r-{n % 2}") for n in range(4)]
    before = datetime.now(UTC)
    results = await publish(create_broker("partner", settings), batch)
    after = datetime.now(UTC)
    assert [r.ok for r in results] == [True] * 4
    receipts = {m.wire.message_id: r.receipt for m, r in zip(batch, results, strict=True)}
    if harness.kind == "servicebus":
        assert set(receipts.values()) == {None}
        return
    parsed = {mid: json.loads(text) for mid, text in receipts.items() if text is not None}
    assert len(parsed) == 4, receipts
    if harness.kind == "rabbitmq":
        for receipt in parsed.values():
            confirmed = datetime.fromisoformat(receipt["confirmed_at"])
            assert before <= confirmed <= after
        return
    arrived = await harness.arrived(destination, 4)
    positions = {a.headers["message-id"]: a.position for a in arrived}
    assert parsed == {mid: positions[mid] for mid in parsed}


async def test_stream_order_holds_inside_a_batch_each_message_once(harness: Harness) -> None:
    settings = harness.settings()
    destination = harness.destination("ordered")
    await harness.prepare(destination)
    batch = [message(settings, destination, n, stream="order-1") for n in range(25)]
    results = await publish(harness.broker("partner", settings), batch)
    assert all(r.ok for r in results)
    arrived = await harness.arrived_once(destination, 25)
    assert [json.loads(a.body)["payload"]["n"] for a in arrived] == list(range(25))


async def test_two_batches_published_at_once_on_a_new_adapter_all_arrive_once(
    harness: Harness,
) -> None:
    # The processor publishes the next batch while the current one is still in flight, so
    # the first two publishes of a fresh adapter race through connect() (and, for NATS,
    # through creating the stream): neither may go out before the adapter is ready.
    settings = harness.settings()
    destination = harness.destination("together")
    await harness.prepare(destination)
    broker = harness.broker("partner", settings)
    batches = [
        [message(settings, destination, n * 4 + i, stream=None) for i in range(4)]
        for n in range(10)
    ]
    publishes = []
    try:
        for batch in batches:  # staggered, so that some start in the middle of connect()
            publishes.append(asyncio.create_task(broker.publish(batch)))
            await asyncio.sleep(0.002)
        results = await asyncio.gather(*publishes)
    finally:
        await broker.close()
    assert [r.error for batch in results for r in batch if not r.ok] == []
    assert len(await harness.arrived_once(destination, 40)) == 40


async def test_an_unreachable_broker_is_a_retryable_failure(harness: Harness) -> None:
    settings = harness.unreachable()
    broker = create_broker("partner", settings)
    batch = [message(settings, harness.destination(), n, stream=None) for n in range(3)]
    try:
        results = await broker.publish(batch)
    except BrokerUnavailable as exc:
        error, results = str(exc), []
    else:  # an adapter may report per message instead; each must be retryable
        error = "; ".join(r.error or "" for r in results)
    finally:
        await broker.close()
    assert all(not r.ok and r.retryable for r in results)
    assert "unreachable" in error or "cannot connect" in error or "cannot reach" in error


async def test_a_refused_message_fails_alone_and_the_rest_arrive_once(harness: Harness) -> None:
    settings = harness.settings()
    destination = harness.destination("fine")
    await harness.prepare(destination)
    if harness.kind == "kafka":  # Kafka refuses a record over max_request_size
        refused = message(settings, destination, 1, stream=None, size=100_000)
    else:
        rejected = harness.rejected_destination()
        await harness.prepare(rejected)
        refused = message(settings, rejected, 1, stream=None)
    fine = message(settings, destination, 2, stream=None)
    results = await publish(harness.broker("partner", settings), [refused, fine])
    assert not results[0].ok
    assert results[0].retryable is harness.refusal_retryable
    assert results[0].error
    assert results[1].ok  # one refusal does not fail the rest
    assert len(await harness.arrived_once(destination, 1)) == 1


async def test_close_and_reconnect_sends_each_message_once(harness: Harness) -> None:
    settings = harness.settings()
    destination = harness.destination("again")
    await harness.prepare(destination)
    broker = harness.broker("partner", settings)
    try:
        assert (await broker.publish([message(settings, destination, 1, stream=None)]))[0].ok
        await broker.close()
        await broker.close()  # idempotent
        await broker.ping()  # reconnects
        assert (await broker.publish([message(settings, destination, 2, stream=None)]))[0].ok
    finally:
        await broker.close()
    assert len(await harness.arrived_once(destination, 2)) == 2


def test_publish_error_carries_retryable() -> None:
    assert PublishError("x", retryable=False).retryable is False
