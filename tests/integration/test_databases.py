"""Several databases in one config: each has its own processors, and fails on its own."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal
from pathlib import Path

import asyncpg

from router import Outbox
from router.config import DatabaseSettings
from router.ops.migrate import upgrade
from tests.conftest import PG_ADMIN, NatsStreams, PgDatabases, make_config, nats_broker
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving


async def test_each_database_delivers_only_its_own_rows(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    stream = nats_streams.stream("int")
    sqlite_url = "sqlite:///embedded.db"
    config = make_config(
        {"pg": pg_url, "lite": sqlite_url},
        {"events": nats_broker(stream, internal=True)},
        base_dir=tmp_path,
    )
    await upgrade("lite", DatabaseSettings.model_validate({"url": sqlite_url}), tmp_path)
    outbox = Outbox(config)
    async with serving(config) as supervisor:
        assert sorted(p.name for p in supervisor.processors) == ["lite/events", "pg/events"]
        async with outbox.transaction("pg") as tx:
            [from_pg] = await tx.stage(OrderPlaced(order_id="pg-1", total=Decimal(1)))
        first = await nats_streams.messages(stream[0], 1)
        async with outbox.transaction("lite") as tx:
            [from_lite] = await tx.stage(OrderPlaced(order_id="lite-1", total=Decimal(2)))
        both = await nats_streams.messages(stream[0], 2)
        await asyncio.sleep(0.3)  # room for a wrong extra delivery to show up
        settled = await nats_streams.messages(stream[0], 3, timeout=0.1)
        assert supervisor.processor("pg", "events").stats.published == 1
        assert supervisor.processor("lite", "events").stats.published == 1
    await outbox.close()
    assert [m.headers["Nats-Msg-Id"] for m in first] == [from_pg]
    assert [m.headers["Nats-Msg-Id"] for m in both] == [from_pg, from_lite]
    assert len(settled) == 2


async def set_connections(name: str, allowed: bool) -> None:
    admin = await asyncpg.connect(PG_ADMIN)
    try:
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}')
        if not allowed:
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name
            )
    finally:
        await admin.close()


async def test_a_database_going_down_does_not_stop_the_other(
    pg_databases: PgDatabases, nats_streams: NatsStreams
) -> None:
    url_a, url_b = await pg_databases.new(), await pg_databases.new()
    name_a = url_a.rsplit("/", 1)[1]
    stream = nats_streams.stream("int")
    config = make_config({"a": url_a, "b": url_b}, {"events": nats_broker(stream, internal=True)})
    outbox = Outbox(config)
    try:
        async with serving(config):
            await set_connections(name_a, allowed=False)
            started = time.monotonic()
            for i in range(3):
                async with outbox.transaction("b") as tx:
                    await tx.stage(OrderPlaced(order_id=f"b-{i}", total=Decimal(i)))
                await nats_streams.messages(stream[0], i + 1, timeout=5)
            assert time.monotonic() - started < 3

            await set_connections(name_a, allowed=True)
            await outbox.engine("a").dispose()  # its pooled connections were terminated
            async with outbox.transaction("a") as tx:
                [from_a] = await tx.stage(OrderPlaced(order_id="a-1", total=Decimal(9)))
            arrived = await nats_streams.messages(stream[0], 4, timeout=20)
    finally:
        await set_connections(name_a, allowed=True)
        await outbox.close()
    assert len(arrived) == 4
    assert arrived[-1].headers["Nats-Msg-Id"] == from_a
