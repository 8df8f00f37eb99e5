"""Service Bus specifics: batches respect the SDK's size limit; an oversized message is
refused on its own."""

from __future__ import annotations

import orjson

from brokers import OutgoingMessage, create_broker
from envelopes import WireMessage, uuid7
from tests.contract.harnesses import ServiceBusHarness
from tests.peers.servicebus import ServiceBusPeer


def wire(n: int, size: int) -> WireMessage:
    return WireMessage(
        message_id=str(uuid7()),
        event_type="bulk",
        body=orjson.dumps({"n": n, "pad": "x" * size}),
        content_type="application/json",
        headers={"message-id": "m"},
    )


async def test_a_large_batch_is_split_at_the_size_limit_and_keeps_its_order(
    servicebus_peer: ServiceBusPeer,
) -> None:
    harness = ServiceBusHarness(servicebus_peer)
    settings = harness.settings(sessions=False)
    destination = harness.destination("bulk")
    messages = [OutgoingMessage(destination, wire(n, 20_000)) for n in range(150)]  # ~3 MB
    broker = create_broker("bus", settings)
    try:
        results = await broker.publish(messages)
    finally:
        await broker.close()
    assert all(r.ok for r in results)
    arrived = await harness.arrived(destination, 150)
    assert [orjson.loads(a.body)["n"] for a in arrived] == list(range(150))


async def test_a_message_larger_than_a_batch_is_refused_alone(
    servicebus_peer: ServiceBusPeer,
) -> None:
    harness = ServiceBusHarness(servicebus_peer)
    settings = harness.settings(sessions=False)
    destination = harness.destination("huge")
    broker = create_broker("bus", settings)
    try:
        results = await broker.publish(
            [
                OutgoingMessage(destination, wire(1, 10)),
                OutgoingMessage(destination, wire(2, 2_000_000)),
                OutgoingMessage(destination, wire(3, 10)),
            ]
        )
    finally:
        await broker.close()
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].retryable is False
    assert "too large" in (results[1].error or "")
    assert len(await harness.arrived(destination, 2)) == 2
