"""The poll wake-up (``wakeup: poll``) with the relay's safety poll an hour away. Events staged
by another process after the relay idled arrive within 200 ms on PostgreSQL (MariaDB's:
tests/integration/test_mysql_wakeup.py). And a row whose
transaction staged it early and commits late, while a row staged after it waits in the queue
(its broker asked for a retry), still arrives within a second of its commit. Its seq is lower
than the newest queued, so a poll of the newest seq alone would not see it (PostgreSQL's poll
watches the oldest running transaction too; MariaDB's, the pending rows)."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from brokers import OutgoingMessage, PublishResult
from router import SyncOutbox
from tests.integration.events import OrderPlaced
from tests.integration.stager_process import connect
from tests.integration.wake_relay import Relay


class RefusingRelay(Relay):
    """A relay on the poll whose broker asks for a retry of the event named "late"."""

    def __init__(self, url: str, base_dir: Path) -> None:
        super().__init__(url, base_dir, wakeup="poll")
        self.tried: dict[str, float] = {}

    def _note(self, message: OutgoingMessage) -> PublishResult | None:
        if b'"late"' in message.wire.body:
            self.tried.setdefault(message.wire.message_id, time.time())
            return PublishResult.failed("try again later", retryable=True)
        return super()._note(message)


def stage(outbox: SyncOutbox, conn: Any, name: str) -> str:
    [message_id] = outbox.stage(conn, OrderPlaced(order_id=name, total=Decimal(1)), stream_key=name)
    return message_id


@pytest.mark.parametrize("database", ["postgresql", "mysql"])
async def test_a_late_commit_of_an_early_row_arrives_within_a_second(
    database: str, pg_url: str, mysql_url: str, tmp_path: Path
) -> None:
    relay = RefusingRelay(pg_url if database == "postgresql" else mysql_url, tmp_path)
    outbox = SyncOutbox.from_file(relay.config_file)
    tried = relay.tried
    early, late = connect(outbox), connect(outbox)
    await relay.runner.start()
    try:
        assert await relay.settled() == "poll", relay.store.wakeup
        await asyncio.sleep(0.3)  # the relay idles
        slow = await asyncio.to_thread(stage, outbox, early, "early")  # its seq first
        quick = await asyncio.to_thread(stage, outbox, late, "late")
        await asyncio.to_thread(late.commit)
        committed = time.time()
        while quick not in tried and time.time() < committed + 2:
            await asyncio.sleep(0.01)
        assert tried[quick] - committed < 1.0  # tried, refused: it stays queued, seq above
        await asyncio.sleep(1.5)  # the poll has long seen the late row's seq
        await asyncio.to_thread(early.commit)
        lateness = await relay.lateness({slow: time.time()}, within=5.0)
    finally:
        await relay.runner.shutdown()
        early.close()
        late.close()
    assert max(lateness) < 1.0, lateness


async def test_postgresql_poll_brings_events_after_idle_gaps_within_200_ms(
    pg_url: str, tmp_path: Path
) -> None:
    relay = Relay(pg_url, tmp_path, wakeup="poll")
    await relay.runner.start()
    try:
        assert await relay.settled() == "poll", relay.store.wakeup
        committed = await relay.stage_elsewhere([[1.0, 3.0, 0.0, 1.0]])
        lateness = await relay.lateness(committed)
    finally:
        await relay.runner.shutdown()
    assert max(lateness) < 0.2, lateness
