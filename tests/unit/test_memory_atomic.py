"""The in-memory broker's atomic write (``MemoryBroker.publish_atomic``): the processor's unit
tests rely on it to keep the contract of a real atomic broker, a unit stored whole or not at
all, with one verdict, and on its handler to refuse a chosen member."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from brokers import MemoryBroker, OutgoingMessage, PublishResult
from envelopes import BrokerUnavailable, WireMessage


def message(n: int, key: str = "k") -> OutgoingMessage:
    wire = WireMessage(
        message_id=str(uuid.UUID(int=n)),
        event_type="order_placed",
        body=b'{"n":%d}' % n,
        content_type="application/json",
        stream_key=key,
    )
    return OutgoingMessage("orders", wire)


def numbers(messages: list[OutgoingMessage]) -> list[int]:
    return [uuid.UUID(m.wire.message_id).int for m in messages]


def refusing(n: int, result: PublishResult) -> MemoryBroker:
    """A memory broker whose handler gives message ``n`` that ``result``."""
    return MemoryBroker(
        "partner", handler=lambda m: result if uuid.UUID(m.wire.message_id).int == n else None
    )


async def test_each_unit_is_stored_whole_and_in_order() -> None:
    broker = MemoryBroker("partner")
    results = await broker.publish_atomic(
        [[message(1), message(2), message(3)], [message(4, key="other")]]
    )
    assert [[r.ok for r in unit] for unit in results] == [[True, True, True], [True]]
    assert numbers(broker.messages) == [1, 2, 3, 4]
    assert [numbers(unit) for unit in broker.units] == [[1, 2, 3], [4]]


async def test_a_refused_member_stores_none_of_its_unit_and_is_named() -> None:
    broker = refusing(2, PublishResult.failed("too big", retryable=False))
    unit, apart = await broker.publish_atomic(
        [[message(1), message(2), message(3)], [message(4, key="other")]]
    )
    assert (
        unit
        == [
            PublishResult.failed(
                f"atomic unit of 3 refused: member 2 ({uuid.UUID(int=2)}): too big", retryable=False
            )
        ]
        * 3
    )
    assert apart == [PublishResult.acked()]
    assert numbers(broker.messages) == [4]
    assert [numbers(u) for u in broker.units] == [[4]]
    assert numbers(broker.attempts) == [1, 2, 3, 4]  # the handler was asked about every member


async def test_a_retryable_refusal_leaves_the_whole_unit_retryable() -> None:
    broker = refusing(3, PublishResult.failed("busy", retryable=True))
    (unit,) = await broker.publish_atomic([[message(1), message(2), message(3)]])
    assert {(r.ok, r.retryable, r.unreachable) for r in unit} == {(False, True, False)}
    assert broker.messages == []


async def test_a_member_cut_off_cuts_off_its_whole_unit() -> None:
    broker = refusing(1, PublishResult.cut_off("no ack within publish_timeout"))
    (unit,) = await broker.publish_atomic([[message(1), message(2)]])
    assert unit == [PublishResult.cut_off("no ack within publish_timeout")] * 2
    assert broker.messages == []


async def test_a_unit_over_max_unit_is_refused_unsent() -> None:
    broker = MemoryBroker("partner")
    broker.max_unit = 2
    too_many, fits = await broker.publish_atomic(
        [[message(1), message(2), message(3)], [message(4, key="other")]]
    )
    assert set(too_many) == {
        PublishResult.failed(
            "an atomic unit of 3 messages; a memory broker's unit holds 2", retryable=False
        )
    }
    assert fits[0].ok
    assert numbers(broker.attempts) == [4]
    assert numbers(broker.messages) == [4]


async def test_a_down_broker_raises_and_stores_nothing() -> None:
    broker = MemoryBroker("partner")
    broker.down = True
    with pytest.raises(BrokerUnavailable):
        await broker.publish_atomic([[message(1)]])
    assert broker.attempts == []
    assert broker.messages == []


async def test_a_stored_unit_wakes_a_test_waiting_for_it() -> None:
    broker = MemoryBroker("partner")
    waiting = asyncio.create_task(broker.wait_for(2, timeout=1))
    await asyncio.sleep(0.01)  # it is waiting before the unit comes
    await broker.publish_atomic([[message(1), message(2)]])
    assert numbers(await waiting) == [1, 2]
