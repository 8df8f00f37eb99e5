"""A JetStream stream deleted while `router serve` runs: re-created and delivered to at once
when stream.create is on; otherwise the target's circuit opens, saying which stream is
missing, and delivery resumes once the operator creates it again."""

from __future__ import annotations

import asyncio
import json
import logging
from decimal import Decimal
from typing import Any

import nats
import pytest
from nats.js.api import StorageType, StreamConfig

from router import Outbox
from tests.conftest import NATS_URL, NatsStreams, make_config, nats_broker, pg_fetch
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving, wait_until

# Three attempts fit in well under a second: an outage of two seconds would abandon every row
# that kept being tried.
RETRY = {"max_attempts": 3, "base_delay": 0.1, "max_delay": 0.2, "jitter": 0.1}


async def rows(url: str) -> dict[str, tuple[str, int, str | None]]:
    """Order id -> (status, attempts, last_error) of every outbox row."""
    records = await pg_fetch(
        url,
        "SELECT envelope::json->'payload'->>'order_id', status, attempts, last_error "
        "FROM router_outbox ORDER BY seq",
    )
    return {r[0]: (r[1], r[2], r[3]) for r in records}


async def recorded_circuit(url: str) -> tuple[str, str | None]:
    """The circuit state and reason `router status` reads from router_targets."""
    records = await pg_fetch(
        url, "SELECT circuit, circuit_error FROM router_targets WHERE target = 'events'"
    )
    return ("closed", None) if not records else (records[0][0], records[0][1])


async def delete_stream(name: str) -> None:
    client = await nats.connect(NATS_URL)
    try:
        await client.jetstream().delete_stream(name)
    finally:
        await client.close()


async def create_stream(stream: tuple[str, str]) -> None:
    """What an operator does: the stream the config names, with its subjects."""
    name, subject = stream
    client = await nats.connect(NATS_URL)
    try:
        await client.jetstream().add_stream(
            StreamConfig(name=name, subjects=[subject + ".>"], storage=StorageType.MEMORY)
        )
    finally:
        await client.close()


def order_ids(messages: list[Any]) -> list[str]:
    """Order ids of internal envelopes, in stream order."""
    return [json.loads(m.data)["payload"]["order_id"] for m in messages]


async def stage(outbox: Outbox, *orders: str) -> None:
    async with outbox.transaction() as tx:
        await tx.stage(*(OrderPlaced(order_id=o, total=Decimal(1)) for o in orders))


async def test_a_deleted_stream_is_created_again_and_the_rows_go_at_their_first_attempt(
    pg_url: str, nats_streams: NatsStreams
) -> None:
    stream = nats_streams.stream("int")
    config = make_config(
        {"main": pg_url},
        {"events": nats_broker(stream, internal=True)},
        outbox={"retry": RETRY, "circuit": {"probe_max_delay": 0.3}},
    )
    outbox = Outbox(config)
    async with serving(config) as supervisor:
        processor = supervisor.processor("main", "events")
        await stage(outbox, "before")
        assert order_ids(await nats_streams.messages(stream[0], 1)) == ["before"]

        await delete_stream(stream[0])
        await stage(outbox, "after-0", "after-1", "after-2")

        async def delivered() -> bool:
            return all(status == "published" for status, _, _ in (await rows(pg_url)).values())

        await wait_until(delivered, timeout=10)
        assert not processor.circuit.is_open
    await outbox.close()

    # The new stream holds what was sent after the deletion (the old one took "before" with it).
    arrived = await nats_streams.messages(stream[0], 3, timeout=2)
    assert order_ids(arrived) == ["after-0", "after-1", "after-2"]
    table = await rows(pg_url)
    assert {order: (status, attempts) for order, (status, attempts, _) in table.items()} == {
        "before": ("published", 1),
        "after-0": ("published", 1),
        "after-1": ("published", 1),
        "after-2": ("published", 1),
    }


async def test_without_stream_create_the_circuit_opens_naming_the_stream_until_it_is_back(
    pg_url: str, nats_streams: NatsStreams, caplog: pytest.LogCaptureFixture
) -> None:
    stream = nats_streams.stream("int")
    await create_stream(stream)
    broker = nats_broker(stream, internal=True)
    broker["stream"] = {**broker["stream"], "create": False}
    config = make_config(
        {"main": pg_url},
        {"events": broker},
        outbox={"retry": RETRY, "circuit": {"probe_max_delay": 0.3}},
    )
    missing = f"stream {stream[0]!r} does not exist"
    outbox = Outbox(config)
    caplog.set_level(logging.INFO, logger="router.relay.circuit")
    async with serving(config) as supervisor:
        processor = supervisor.processor("main", "events")
        await stage(outbox, "before")
        assert order_ids(await nats_streams.messages(stream[0], 1)) == ["before"]

        await delete_stream(stream[0])
        await stage(outbox, "tried-0", "tried-1")

        async def circuit_open() -> bool:
            return processor.circuit.is_open and (await recorded_circuit(pg_url))[0] == "open"

        await wait_until(circuit_open, timeout=5)
        await stage(outbox, "held-0", "held-1")
        # Far longer than three attempts' worth of backoff (0.1 + 0.2 + 0.2 s).
        await asyncio.sleep(2.0)
        during = await rows(pg_url)
        reason = processor.circuit.reason
        state, recorded_reason = await recorded_circuit(pg_url)
        assert processor.circuit.is_open

        await create_stream(stream)  # the operator puts it back

        async def delivered() -> bool:
            return all(status == "published" for status, _, _ in (await rows(pg_url)).values())

        await wait_until(delivered, timeout=8)
        after = await rows(pg_url)
        assert not processor.circuit.is_open
        assert processor.circuit.reason is None
    await outbox.close()

    assert missing in (reason or "")
    assert state == "open" and missing in (recorded_reason or "")
    opened = [r for r in caplog.records if r.getMessage() == "circuit.opened"]
    assert opened and missing in opened[0].error
    # Tried when the stream was found missing, and given back untried: the circuit holds
    # every row, none spends an attempt on the missing stream, none is abandoned.
    assert {order: (status, attempts) for order, (status, attempts, _) in during.items()} == {
        "before": ("published", 1),
        "tried-0": ("pending", 0),
        "tried-1": ("pending", 0),
        "held-0": ("pending", 0),
        "held-1": ("pending", 0),
    }
    arrived = await nats_streams.messages(stream[0], 4, timeout=2)
    assert sorted(order_ids(arrived)) == ["held-0", "held-1", "tried-0", "tried-1"]
    assert {order: attempts for order, (_, attempts, _) in after.items()} == {
        "before": 1,
        "tried-0": 1,
        "tried-1": 1,
        "held-0": 1,
        "held-1": 1,
    }
