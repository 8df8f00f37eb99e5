"""The in-process fast path: a commit in the router's own process wakes its processors
directly, without waiting for the file watcher, NOTIFY or the poll."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from brokers import Broker, BrokerSettings, MemoryBroker
from router import Event, Outbox, Runner
from router.config import DatabaseSettings
from router.ops.migrate import upgrade
from router.relay.store.sqlite import SqliteStore
from tests.conftest import make_config


class Noted(Event, type="noted"):
    n: int


async def test_a_commit_in_process_wakes_the_processor_at_once(tmp_path: Path) -> None:
    await upgrade("main", DatabaseSettings.model_validate({"url": "sqlite:///o.db"}), tmp_path)
    config = make_config(
        {"main": "sqlite:///o.db"},
        {"events": {"type": "memory", "internal": True}},
        base_dir=tmp_path,
        outbox={"poll_interval": 3600},
    )
    broker = MemoryBroker("events")

    def factory(name: str, settings: BrokerSettings) -> Broker:
        return broker

    supervisor = Runner(config, broker_factory=factory)
    store = supervisor.stores["main"]
    assert isinstance(store, SqliteStore)
    store.watch_interval = 3600  # the file watcher would wake it too: take it out of play
    outbox = Outbox(config)
    await supervisor.start()
    try:
        await asyncio.sleep(0.2)  # the processors have looked once and now sleep
        started = time.monotonic()
        async with outbox.transaction() as tx:
            await tx.stage(Noted(n=1))
        await broker.wait_for(1, timeout=2)
        by_transaction = time.monotonic() - started

        sessions = async_sessionmaker(outbox.engine(), class_=AsyncSession)
        started = time.monotonic()
        async with sessions() as session, session.begin():
            await outbox.stage(session, Noted(n=2))
        await broker.wait_for(2, timeout=2)
        by_session = time.monotonic() - started
    finally:
        await supervisor.shutdown()
        await outbox.close()
    assert by_transaction < 0.5
    assert by_session < 0.5
