"""PostgreSQL connections cut under a running router (as in a server crash or a failover):
every error is handled where it happens, none is left in a task for asyncio to report
("Task exception was never retrieved"), and delivery resumes with nothing lost. The test's
own database is the only one whose connections are cut."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from brokers import OutgoingMessage, PublishResult
from brokers.memory import MemoryBroker
from router import Outbox
from tests.conftest import PgDatabases, make_config
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving

BROKERS = {"events": {"type": "memory", "internal": True}, "partner": {"type": "memory"}}
ROWS = 600
# Small batches and a broker that takes a few milliseconds: each run of batches marks several
# times, so connections are cut while claims, publishes and marks overlap.
OUTBOX = {"batch_size": 10, "retry": {"base_delay": 0.05, "max_delay": 0.2}}
CUTS = 8


class SlowBroker(MemoryBroker):
    """A memory broker that takes 5 ms a batch."""

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        await asyncio.sleep(0.005)
        return await super().publish(batch)


async def stage(url: str) -> None:
    outbox = Outbox(make_config({"main": url}, BROKERS))
    try:
        async with outbox.transaction() as tx:
            await tx.stage(
                *(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(ROWS)),
                stream_keys=[f"order-{i % 20}" for i in range(ROWS)],
            )
    finally:
        await outbox.close()


async def cut(admin: asyncpg.Connection, database: str) -> int:
    """Terminate every other session on ``database``; how many there were."""
    found = await admin.fetchval(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE datname = $1 AND pid <> pg_backend_pid()",
        database,
    )
    return int(found or 0)


async def published(admin: asyncpg.Connection) -> int:
    return int(
        await admin.fetchval("SELECT count(*) FROM router_outbox WHERE status = 'published'")
    )


async def test_cut_connections_leave_no_task_exception_unretrieved(
    pg_databases: PgDatabases, caplog: pytest.LogCaptureFixture
) -> None:
    url = await pg_databases.new()
    database = url.rsplit("/", 1)[1]
    config = make_config({"main": url}, BROKERS, outbox=OUTBOX)
    brokers: dict[str, MemoryBroker] = {}

    def factory(name: str, settings: Any) -> MemoryBroker:
        brokers[name] = SlowBroker(name)
        return brokers[name]

    caplog.set_level(logging.WARNING)
    admin = await asyncpg.connect(url)
    try:
        async with serving(config, broker_factory=factory, start_embedded=False):
            await stage(url)
            killed = 0
            for _ in range(CUTS):  # while the batches are delivered
                await asyncio.sleep(0.15)
                killed += await cut(admin, database)
            assert killed >= CUTS  # something was cut each time
            deadline = time.monotonic() + 30
            while await published(admin) < 2 * ROWS:
                assert time.monotonic() < deadline, await published(admin)
                await asyncio.sleep(0.1)
    finally:
        await admin.close()
    gc.collect()  # a task's unretrieved exception is reported when the task is collected
    await asyncio.sleep(0)

    assert {len(set(b.ids())) for b in brokers.values()} == {ROWS}  # nothing lost
    unretrieved = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert unretrieved == []
    # A run's batches are lost together: one error per run cut, not one per batch.
    lost = [r for r in caplog.records if r.getMessage() == "batch.mark_failed"]
    assert all(r.levelname == "ERROR" for r in lost)
    assert len(lost) <= CUTS * len(BROKERS)
