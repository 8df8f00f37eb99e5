"""How the relay makes and keeps units on an ``atomic`` target, on PostgreSQL, SQLite and
MariaDB, with the in-memory broker (its ``publish_atomic`` stores a unit whole or not at all and records it):
a claim that cuts a transaction completes it, a unit waits behind another transaction's failed
row of its stream, a held unit goes only once every member is released, and requeuing part of
an abandoned unit brings the whole unit back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from brokers import Broker, BrokerSettings, MemoryBroker, OutgoingMessage, PublishResult
from router import Outbox, Runner
from router.config import RouterConfig
from router.ops.held import release
from router.ops.outbox import requeue
from tests.conftest import Database, make_config
from tests.integration.events import OrderPlaced, StockReserved

Handler = Callable[[OutgoingMessage], PublishResult | None]


def config_of(database: Database, **outbox: Any) -> RouterConfig:
    brokers = {
        "events": {"type": "memory", "internal": True, "atomic": True, **outbox.pop("broker", {})}
    }
    retry = {"base_delay": 0.2, "max_delay": 0.2, "jitter": 0}
    return make_config(
        {"main": database.url}, brokers, database.base_dir, outbox={"retry": retry, **outbox}
    )


async def stage(config: RouterConfig, keys: list[str], name: str) -> list[str]:
    """One transaction: an event on each of ``keys``, named ``name``-0, -1, ...; their ids."""
    outbox = Outbox(config)
    try:
        async with outbox.transaction() as tx:
            return await tx.stage(
                *(OrderPlaced(order_id=f"{name}-{i}", total=Decimal(i)) for i in range(len(keys))),
                stream_keys=keys,
            )
    finally:
        await outbox.close()


def serve(config: RouterConfig, handler: Handler | None = None) -> tuple[Runner, MemoryBroker]:
    broker = MemoryBroker("events", handler=handler)

    def factory(name: str, settings: BrokerSettings) -> Broker:
        return broker

    return Runner(config, broker_factory=factory, serve_http=False, run_cleanup=False), broker


def units(broker: MemoryBroker) -> list[list[str]]:
    return [[m.wire.message_id for m in unit] for unit in broker.units]


async def statuses(database: Database) -> dict[str, tuple[str, int]]:
    return {r["message_id"]: (r["status"], r["attempts"]) for r in await database.rows()}


async def until(condition: Callable[[], Any], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_claim_that_cuts_a_transaction_claims_on_and_sends_it_whole(
    database: Database,
) -> None:
    # Batches of two: the first claim takes two of the first transaction's four rows.
    config = config_of(database, batch_size=2)
    first = await stage(config, ["a", "b", "c", "d"], "t1")
    second = await stage(config, ["e"], "t2")
    runner, broker = serve(config)
    await runner.start()
    try:
        await broker.wait_for(5)
    finally:
        await runner.shutdown()
    assert units(broker) == [first, second]


async def test_a_unit_waits_behind_another_transactions_failed_row_of_its_stream(
    database: Database,
) -> None:
    """t1's row on ``a`` fails once (retryable); t2 staged rows on ``b`` and ``a``: neither goes,
    not even ``b``'s, until t1's row is stored; then t2 goes whole, after it."""
    config = config_of(database)
    [late] = await stage(config, ["a"], "t1")
    second = await stage(config, ["b", "a"], "t2")
    failures = [late]

    def fail_once(message: OutgoingMessage) -> PublishResult | None:
        if message.wire.message_id in failures:
            failures.remove(message.wire.message_id)
            return PublishResult.failed("try later", retryable=True)
        return None

    runner, broker = serve(config, fail_once)
    await runner.start()
    try:
        await broker.wait_for(3)
    finally:
        await runner.shutdown()
    assert units(broker) == [[late], second]
    tried = [m.wire.message_id for m in broker.attempts]
    assert tried == [late, late, *second]  # t2's rows were never sent before t1's retry
    assert {status for status, _ in (await statuses(database)).values()} == {"published"}


async def test_a_held_unit_goes_only_once_every_member_is_released(
    database: Database,
) -> None:
    """``ordering: hold``: t1 (rows on ``a`` and ``b``) is refused for good: both rows are held.
    Releasing ``a`` alone sends nothing (``b`` still holds the unit); releasing ``b`` too sends
    the unit whole, once the broker takes it."""
    config = config_of(database, broker={"ordering": "hold"})
    first = await stage(config, ["a", "b"], "t1")
    refusing = True

    def refuse(message: OutgoingMessage) -> PublishResult | None:
        return PublishResult.failed("too large", retryable=False) if refusing else None

    runner, broker = serve(config, refuse)
    await runner.start()
    try:

        async def held() -> bool:
            return {s for s, _ in (await statuses(database)).values()} == {"held"}

        await until(held)
        refusing = False
        await release(config, "events", "a", reason="test", actor="test")
        await asyncio.sleep(1.0)  # time for a claim and a publish, were either to happen
        assert broker.units == []

        async def untried() -> bool:
            # Released afresh and untried since. The release wakes the relay, whose claim
            # may hold the row at the moment we look (it finds the unit incomplete and gives
            # it back, or on SQLite rolls the claim back), but never counts an attempt.
            return (await statuses(database))[first[0]] == ("pending", 0)

        await until(untried)
        assert broker.units == []
        # Waiting for its other member is idle: the relay does not claim the released row
        # over and over (it did, hundreds of times a second on PostgreSQL).
        [processor] = runner.processors
        batches = processor.stats.batches
        await asyncio.sleep(2.0)
        assert processor.stats.batches - batches <= 2
        await release(config, "events", "b", reason="test", actor="test")
        await broker.wait_for(2)
    finally:
        await runner.shutdown()
    assert units(broker) == [first]


async def test_requeuing_part_of_an_abandoned_unit_brings_the_whole_unit_back(
    database: Database,
) -> None:
    """t1 (an ``order_placed`` and a ``stock_reserved``) and t2 (an ``order_placed``) are
    refused for good and abandoned (``ordering: skip``). ``router requeue --event-type
    stock_reserved`` picks one row of t1: it brings back t1's other member too, and nothing of
    t2; t1 then goes as one unit, once, whole."""
    config = config_of(database)
    outbox = Outbox(config)
    try:
        async with outbox.transaction() as tx:
            first = await tx.stage(
                OrderPlaced(order_id="t1-0", total=Decimal(1)),
                StockReserved(order_id="t1-1", quantity=1),
                stream_keys=["a", "b"],
            )
    finally:
        await outbox.close()
    [second] = await stage(config, ["c"], "t2")
    runner, broker = serve(config, lambda _: PublishResult.failed("refused", retryable=False))
    await runner.start()
    try:

        async def abandoned() -> bool:
            return {s for s, _ in (await statuses(database)).values()} == {"abandoned"}

        await until(abandoned)
    finally:
        await runner.shutdown()

    dry = await requeue(config, event_types=["stock_reserved"], dry_run=True)
    done = await requeue(config, event_types=["stock_reserved"])

    assert dry == done == {"main": 2}
    found = await statuses(database)
    assert [found[i] for i in first] == [("pending", 0)] * 2
    assert found[second][0] == "abandoned"
    runner, broker = serve(config)
    await runner.start()
    try:
        await broker.wait_for(2)
        await asyncio.sleep(0.5)  # time for a stray part, were one to go
    finally:
        await runner.shutdown()
    assert units(broker) == [first]
