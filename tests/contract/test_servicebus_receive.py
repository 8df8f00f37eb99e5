"""A partner reads Service Bus with the Azure SDK's receiver, and the peer settles as Service Bus
does: a completed message is gone, an abandoned one comes back, a session receiver gets its
session only, RECEIVE_AND_DELETE takes what it gets, and what the peer does not implement is
refused with a clean error."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from azure.servicebus import ServiceBusReceiveMode
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import ServiceBusError

from brokers import OutgoingMessage, create_broker
from envelopes import WireMessage, uuid7
from tests.contract.harnesses import ServiceBusHarness
from tests.peers.servicebus import ServiceBusPeer


@pytest.fixture
def harness(servicebus_peer: ServiceBusPeer) -> ServiceBusHarness:
    return ServiceBusHarness(servicebus_peer)


@pytest.fixture
async def client(harness: ServiceBusHarness) -> AsyncIterator[ServiceBusClient]:
    async with ServiceBusClient.from_connection_string(harness.peer.connection_string) as c:
        yield c


async def publish(
    harness: ServiceBusHarness, destination: str, *streams: str, sessions: bool = True
) -> list[str]:
    """Send one event per stream key through the adapter; return their message ids."""
    wires = [
        WireMessage(
            message_id=str(uuid7()),
            event_type="order_placed",
            body=b'{"n": %d}' % n,
            content_type="application/json",
            headers={"message-id": "m"},
            stream_key=stream,
        )
        for n, stream in enumerate(streams)
    ]
    broker = create_broker("bus", harness.settings(sessions=sessions))
    try:
        results = await broker.publish([OutgoingMessage(destination, w) for w in wires])
    finally:
        await broker.close()
    assert all(r.ok for r in results), results
    return [w.message_id for w in wires]


async def test_a_completed_message_is_gone(harness: ServiceBusHarness) -> None:
    destination = harness.destination()
    [sent] = await publish(harness, destination, "order-1")

    [got] = await harness.receive(destination, 1, session_id="order-1")

    assert got.native_id == sent
    assert await harness.receive(destination, 1, session_id="order-1", timeout=1) == []


async def test_an_abandoned_message_comes_back(
    harness: ServiceBusHarness, client: ServiceBusClient
) -> None:
    destination = harness.destination()
    [sent] = await publish(harness, destination, "order-1")

    async with client.get_queue_receiver(destination, session_id="order-1") as receiver:
        [first] = await receiver.receive_messages(max_message_count=1, max_wait_time=10)
        await receiver.abandon_message(first)
        [again] = await receiver.receive_messages(max_message_count=1, max_wait_time=10)
        assert again.message_id == first.message_id == sent
        assert b"".join(again.body) == b"".join(first.body)
        await receiver.complete_message(again)

    assert await harness.receive(destination, 1, session_id="order-1", timeout=1) == []


async def test_a_message_a_session_receiver_left_unsettled_goes_to_the_next_receiver(
    harness: ServiceBusHarness, client: ServiceBusClient
) -> None:
    destination = harness.destination()
    [sent] = await publish(harness, destination, "order-1")

    async with client.get_queue_receiver(destination, session_id="order-1") as receiver:
        [held] = await receiver.receive_messages(max_message_count=1, max_wait_time=10)
    assert held.message_id == sent

    assert [a.native_id for a in await harness.receive(destination, 1, "order-1")] == [sent]


async def test_a_session_receiver_gets_its_session_only_in_order(
    harness: ServiceBusHarness,
) -> None:
    destination = harness.destination()
    ids = await publish(harness, destination, "order-1", "order-2", "order-1", "order-2")

    first = await harness.receive(destination, 2, session_id="order-1")
    second = await harness.receive(destination, 2, session_id="order-2")

    assert [a.native_id for a in first] == [ids[0], ids[2]]
    assert [a.native_id for a in second] == [ids[1], ids[3]]
    assert {a.key for a in first} == {"order-1"}


async def test_a_plain_receiver_in_receive_and_delete_mode_takes_every_message(
    harness: ServiceBusHarness, client: ServiceBusClient
) -> None:
    destination = harness.destination()
    ids = await publish(harness, destination, "order-1", "order-2", sessions=False)

    async with client.get_queue_receiver(
        destination, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
    ) as receiver:
        got = await receiver.receive_messages(max_message_count=2, max_wait_time=10)

    assert [m.message_id for m in got] == ids
    assert await harness.receive(destination, 1, timeout=1) == []


async def test_what_the_peer_does_not_implement_is_refused_with_a_clean_error(
    harness: ServiceBusHarness, client: ServiceBusClient
) -> None:
    destination = harness.destination()
    await publish(harness, destination, "order-1", sessions=False)

    async with client.get_queue_receiver(destination) as receiver:
        with pytest.raises(ServiceBusError, match="501"):
            await receiver.peek_messages(1)  # a $management request
        [message] = await receiver.receive_messages(max_message_count=1, max_wait_time=10)
        with pytest.raises(ServiceBusError, match="neither defers nor dead-letters"):
            await receiver.dead_letter_message(message, reason="test")

    assert len(await harness.receive(destination, 1)) == 1  # still there, and deliverable
