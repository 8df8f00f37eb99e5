"""A partner outage opens the target's circuit at the first unanswered publish: no row spends
an attempt on it (the one in flight goes back untried too), probes find the broker again, and
delivery resumes."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import nats
import orjson

from brokers.nats import EmbeddedNats
from router import Outbox
from tests.conftest import NatsStreams, make_config, nats_broker
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving, wait_until
from tests.services import free_port


async def partner_rows(url: str) -> list[tuple[str, str, int]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT envelope::json->'payload'->>'order_id', status, attempts FROM router_outbox "
            "WHERE target = 'partner' ORDER BY seq"
        )
    finally:
        await conn.close()
    return [(r[0], r[1], r[2]) for r in rows]


def order_ids(messages: list[Any]) -> list[str]:
    """The order id of each JetStream message, in stream order."""
    return [orjson.loads(m.data)["payload"]["order_id"] for m in messages]


async def stream_order_ids(url: str, stream: str) -> list[str]:
    """Every order id ``stream`` holds on the server at ``url``, in stream order."""
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        total = (await js.stream_info(stream)).state.messages
        return order_ids([await js.get_msg(stream, seq=i) for i in range(1, total + 1)])
    finally:
        await client.close()


async def test_an_outage_longer_than_all_retries_spends_no_attempt_and_abandons_nothing(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    port = free_port()
    internal, partner = nats_streams.stream("int"), nats_streams.stream("ext")
    partner_settings = nats_broker(partner, url=f"nats://127.0.0.1:{port}", connect_timeout=0.5)
    config = make_config(
        {"main": pg_url},
        {"events": nats_broker(internal, internal=True), "partner": partner_settings},
        outbox={
            "retry": {"max_attempts": 3, "base_delay": 0.1, "max_delay": 0.2, "jitter": 0.1},
            "circuit": {"probe_max_delay": 0.3},
        },
    )
    outbox = Outbox(config)
    server = EmbeddedNats(f"nats://127.0.0.1:{port}", tmp_path / "partner-nats")
    async with serving(config) as supervisor:
        processor = supervisor.processor("main", "partner")
        async with outbox.transaction() as tx:
            await tx.stage(OrderPlaced(order_id="before", total=Decimal(1)))

        async def circuit_open() -> bool:
            return processor.circuit.is_open

        await wait_until(circuit_open, timeout=10)
        async with outbox.transaction() as tx:
            await tx.stage(
                *(OrderPlaced(order_id=f"during-{i}", total=Decimal(i)) for i in range(5))
            )
        # Far longer than three attempts' worth of backoff (0.1 + 0.2 + 0.2 s).
        await asyncio.sleep(2.0)
        during_outage = await partner_rows(pg_url)
        # The outage stays the partner's: the internal target got every event, in order, and
        # each once (read after the sleep, so a late repeat would be among them).
        internal_arrived = order_ids(await nats_streams.messages(internal[0], 6))

        await server.start()
        try:

            async def delivered() -> bool:
                rows = await partner_rows(pg_url)
                return all(status in ("published", "abandoned") for _, status, _ in rows)

            await wait_until(delivered, timeout=15)
            after = await partner_rows(pg_url)
            assert not processor.circuit.is_open
            partner_arrived = await stream_order_ids(f"nats://127.0.0.1:{port}", partner[0])
        finally:
            await server.stop()
    await outbox.close()

    # "before" was tried, went unanswered, and was given back with its attempt uncounted.
    assert during_outage == [
        (order, "pending", 0) for order in ["before", *(f"during-{i}" for i in range(5))]
    ]
    assert {status for _, status, _ in after} == {"published"}
    expected = ["before", *(f"during-{i}" for i in range(5))]
    assert internal_arrived == expected
    assert partner_arrived == expected
