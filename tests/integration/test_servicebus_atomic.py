"""Atomic units through the Service Bus adapter (``ServiceBusBroker.publish_atomic``): each unit
one ``ServiceBusMessageBatch`` sent with one ``send_messages``, against the AMQP 1.0 peer, and
read back with the Azure SDK's receiver as a partner would (per session: the stream key)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from brokers import AtomicBroker, OutgoingMessage, PublishResult, create_broker
from brokers.servicebus._adapter import MAX_UNIT
from envelopes import BrokerUnavailable
from tests.contract.harnesses import Arrived, ServiceBusHarness
from tests.contract.test_contract import message
from tests.peers.servicebus import Received, ServiceBusPeer


@pytest.fixture
def harness(servicebus_peer: ServiceBusPeer) -> ServiceBusHarness:
    return ServiceBusHarness(servicebus_peer)


def unit(
    settings: Any, destination: str, numbers: range, *, stream: str | None, size: int = 0
) -> list[OutgoingMessage]:
    return [message(settings, destination, n, stream=stream, size=size) for n in numbers]


def numbers(arrived: Sequence[Arrived | Received]) -> list[int]:
    return [orjson.loads(a.body)["payload"]["n"] for a in arrived]


async def publish_atomic(
    settings: Any, units: list[list[OutgoingMessage]]
) -> list[list[PublishResult]]:
    broker = create_broker("bus", settings)
    assert isinstance(broker, AtomicBroker)
    try:
        return await broker.publish_atomic(units)
    finally:
        await broker.close()


async def test_units_are_stored_whole_and_read_back_per_session(
    harness: ServiceBusHarness,
) -> None:
    settings = harness.settings()
    orders = harness.destination("orders")
    first = unit(settings, orders, range(1, 4), stream="a")
    second = unit(settings, orders, range(4, 5), stream="b")
    results = await publish_atomic(settings, [first, second])
    # Service Bus acknowledges a send without naming a position: no receipt, as publish.
    assert results == [[PublishResult.acked()] * 3, [PublishResult.acked()]]
    a = await harness.receive(orders, 3, session_id="a")
    b = await harness.receive(orders, 1, session_id="b")
    assert numbers(a) == [1, 2, 3] and numbers(b) == [4]
    assert [x.native_id for x in a + b] == [m.wire.message_id for m in first + second]
    assert {x.key for x in a} == {"a"}


async def test_a_member_too_large_for_a_batch_stores_none_and_is_named(
    harness: ServiceBusHarness,
) -> None:
    settings = harness.settings()
    orders = harness.destination("orders")
    refused_unit = [
        message(settings, orders, 1, stream="a"),
        message(settings, orders, 2, stream="a", size=2_000_000),
        message(settings, orders, 3, stream="a"),
    ]
    refused, apart = await publish_atomic(
        settings, [refused_unit, unit(settings, orders, range(4, 5), stream="b")]
    )
    assert len(set(refused)) == 1, "one verdict for the whole unit"
    assert not refused[0].ok and not refused[0].retryable and not refused[0].unreachable
    assert (refused[0].error or "").startswith(
        f"atomic unit of 3 refused: member 2 ({refused_unit[1].wire.message_id}): "
        f"does not fit in one batch for {orders!r} with the members before it (at most "
    )
    assert apart == [PublishResult.acked()]
    assert numbers(await harness.receive(orders, 1, session_id="b")) == [4]
    assert numbers(await harness.receive(orders, 1, session_id="a", timeout=1)) == []
    assert numbers(harness.peer.messages(orders)) == [4]  # nothing of the unit was sent


async def test_a_unit_over_the_size_limit_is_refused_unsent_where_publish_would_split_it(
    harness: ServiceBusHarness,
) -> None:
    # Each member fits a batch (1 MB from the peer's link); the three together do not.
    settings = harness.settings(sessions=False)
    orders = harness.destination("orders")
    members = unit(settings, orders, range(1, 4), stream="a", size=400_000)
    (refused,) = await publish_atomic(settings, [members])
    assert len(set(refused)) == 1
    assert not refused[0].ok and not refused[0].retryable
    assert f"member 3 ({members[2].wire.message_id}): does not fit" in (refused[0].error or "")
    assert harness.peer.messages(orders) == []
    broker = create_broker("bus", settings)
    try:
        assert all(r.ok for r in await broker.publish(members))  # in two batches
    finally:
        await broker.close()
    assert numbers(await harness.arrived(orders, 3)) == [1, 2, 3]


async def test_a_unit_the_entity_refuses_stores_none_while_the_next_unit_goes(
    harness: ServiceBusHarness,
) -> None:
    settings = harness.settings()
    missing, orders = harness.rejected_destination(), harness.destination("orders")
    refused, apart = await publish_atomic(
        settings,
        [
            unit(settings, missing, range(1, 3), stream="a"),
            unit(settings, orders, range(3, 4), stream="b"),
        ],
    )
    assert len(set(refused)) == 1
    assert not refused[0].ok and not refused[0].retryable
    assert (refused[0].error or "").startswith("atomic unit of 2 refused whole: rejected by")
    assert "could not be found" in (refused[0].error or "")
    assert apart == [PublishResult.acked()]
    assert harness.peer.messages(missing) == []
    assert numbers(await harness.receive(orders, 1, session_id="b")) == [3]


async def test_a_unit_bound_for_two_entities_is_refused_unsent(
    harness: ServiceBusHarness,
) -> None:
    settings = harness.settings()
    orders, audit = harness.destination("orders"), harness.destination("audit")
    members = [
        message(settings, orders, 1, stream="a"),
        message(settings, audit, 2, stream="a"),
    ]
    (refused,) = await publish_atomic(settings, [members])
    assert set(refused) == {
        PublishResult.failed(
            f"atomic unit of 2 refused: member 2 ({members[1].wire.message_id}): goes to "
            f"{audit!r} and member 1 to {orders!r}: a Service Bus batch goes to one entity",
            retryable=False,
        )
    }
    assert harness.peer.messages(orders) == [] and harness.peer.messages(audit) == []


async def test_a_unit_over_the_batch_count_limit_is_refused_unsent(
    harness: ServiceBusHarness,
) -> None:
    settings = harness.settings(sessions=False)
    orders = harness.destination("orders")
    (refused,) = await publish_atomic(
        settings, [unit(settings, orders, range(MAX_UNIT + 1), stream=None)]
    )
    assert set(refused) == {
        PublishResult.failed(
            f"an atomic unit of {MAX_UNIT + 1:,} messages; a Service Bus batch holds {MAX_UNIT:,}",
            retryable=False,
        )
    }
    assert harness.peer.messages(orders) == []


async def test_an_unreachable_namespace_raises_broker_unavailable(
    harness: ServiceBusHarness,
) -> None:
    settings = harness.unreachable()
    with pytest.raises(BrokerUnavailable):
        await publish_atomic(settings, [unit(settings, "orders", range(1, 3), stream="a")])
