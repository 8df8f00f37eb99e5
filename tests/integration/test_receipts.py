"""Broker receipts: each published row keeps where its broker put the message, and
``router trace`` shows it per target, on every database kind against the five real peers."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal

from router import Outbox
from router.ops.outbox import TraceRow, trace
from tests.conftest import Database
from tests.contract.harnesses import Harness
from tests.integration.events import OrderPlaced
from tests.integration.five import config_for
from tests.integration.test_delivery import serving, wait_until


async def test_trace_shows_each_targets_receipt(
    database: Database, partners: dict[str, Harness]
) -> None:
    config = config_for(database.url, partners, database.base_dir)
    destinations = {name: h.destination("order_placed") for name, h in partners.items()}
    for name, harness in partners.items():
        await harness.prepare(destinations[name])
    outbox = Outbox(config)
    started = datetime.now(UTC)
    async with serving(config):
        async with outbox.transaction() as tx:
            ids = await tx.stage(
                *(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(3)),
                stream_key="customer-1",
            )
        rows: dict[str, list[TraceRow]] = {}

        async def all_published() -> bool:
            for message_id in ids:
                rows[message_id] = await trace(config, message_id)
            return all(r.status == "published" for found in rows.values() for r in found)

        await wait_until(all_published, timeout=30)
    await outbox.close()
    finished = datetime.now(UTC)

    arrived = {
        name: {a.headers["message-id"]: a for a in await h.arrived(destinations[name], 3)}
        for name, h in partners.items()
        if name not in ("rabbitmq", "servicebus")
    }
    for message_id, found in rows.items():
        by_target = {r.target: r for r in found}
        assert set(by_target) == set(partners)
        for name, row in by_target.items():
            assert row.attempts == 1
            assert row.first_attempt_at is not None and row.first_attempt_at == row.last_attempt_at
            assert row.published_at is not None and row.first_attempt_at <= row.published_at
            if name == "servicebus":  # the SDK's send returns nothing to keep
                assert row.receipt is None
            elif name == "rabbitmq":  # a publisher confirm names no position: its time
                assert row.receipt is not None
                confirmed = datetime.fromisoformat(row.receipt["confirmed_at"])
                assert started <= confirmed <= finished
            else:  # the position the broker's own client reads the message at
                assert row.receipt == arrived[name][message_id].position, name
    # The receipt is stored as the broker gave it: JSON text on the row, whatever the database.
    [stored] = await database.execute(
        "SELECT receipt FROM router_outbox WHERE target = 'kafka' ORDER BY seq LIMIT 1"
    )
    assert json.loads(stored["receipt"])["offset"] >= 0
