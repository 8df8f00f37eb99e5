"""The processor with the in-memory broker, on a real SQLite outbox."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from brokers import MemoryBroker, OutgoingMessage, PublishResult
from router import Event, Outbox, Processor, RouterConfig
from router._store.sqlite import SqliteStore
from router.config import DatabaseSettings
from router.migrate import upgrade
from tests.conftest import make_config


class Placed(Event, type="placed", published=True):
    n: int


class Harness:
    """An outbox file, an Outbox to stage with, and processors over a memory broker."""

    def __init__(self, folder: Path, **outbox: Any) -> None:
        self.folder = folder
        self.config: RouterConfig = make_config(
            {"main": "sqlite:///outbox.db"},
            {
                "events": {
                    "type": "memory",
                    "internal": True,
                    "connect_timeout": 0.2,
                    "publish_timeout": 0.2,
                }
            },
            base_dir=folder,
            outbox={
                "retry": {"base_delay": 1.0, "max_delay": 10, "jitter": 0.2, "max_attempts": 3},
                **outbox,
            },
        )
        self.outbox = Outbox(self.config)
        self.store = SqliteStore("main", folder / "outbox.db", watch_interval=0.01)
        self.broker = MemoryBroker("events")

    def processor(self, worker: str = "w1", rand: float = 0.5) -> Processor:
        return Processor(
            database="main",
            target="events",
            settings=self.config.brokers["events"],
            broker=self.broker,
            store=self.store,
            outbox=self.config.outbox,
            worker_id=worker,
            rand=lambda: rand,
        )

    async def stage(self, *numbers: int, stream_key: str | None = None) -> list[str]:
        async with self.outbox.transaction() as tx:
            return await tx.stage(*(Placed(n=n) for n in numbers), stream_key=stream_key)

    def rows(self) -> list[dict[str, Any]]:
        with sqlite3.connect(self.folder / "outbox.db") as db:
            db.row_factory = sqlite3.Row
            return [dict(r) for r in db.execute("SELECT * FROM router_outbox ORDER BY seq")]

    def statuses(self) -> list[str]:
        return [row["status"] for row in self.rows()]


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    await upgrade("main", DatabaseSettings.model_validate({"url": "sqlite:///outbox.db"}), tmp_path)
    h = Harness(tmp_path)
    yield h
    await h.outbox.close()
    await h.store.close()


def numbers(broker: MemoryBroker) -> list[int]:
    return [orjson.loads(m.wire.body)["payload"]["n"] for m in broker.messages]


def failing(*values: int, retryable: bool = True) -> Any:
    def handler(message: OutgoingMessage) -> PublishResult | None:
        if orjson.loads(message.wire.body)["payload"]["n"] in values:
            return PublishResult.failed(f"refused {values}", retryable=retryable)
        return None

    return handler


async def test_drain_publishes_every_row_in_order_and_marks_it(harness: Harness) -> None:
    await harness.stage(1, 2, 3)
    await harness.stage(4, 5)
    assert await harness.processor().drain() == 5
    assert numbers(harness.broker) == [1, 2, 3, 4, 5]
    assert harness.statuses() == ["published"] * 5
    assert all(row["published_at"] and row["locked_by"] is None for row in harness.rows())


async def test_a_full_batch_is_followed_at_once_by_the_next(tmp_path: Path) -> None:
    await upgrade("main", DatabaseSettings.model_validate({"url": "sqlite:///outbox.db"}), tmp_path)
    h = Harness(tmp_path, batch_size=2)
    await h.stage(*range(5))
    processor = h.processor()
    assert await processor.drain() == 5
    assert processor.stats.batches == 3
    await h.outbox.close()
    await h.store.close()


async def test_a_retryable_failure_waits_its_backoff_while_the_rest_is_published(
    harness: Harness,
) -> None:
    harness.broker.handler = failing(2)
    await harness.stage(1, 2, 3)
    before = datetime.now(UTC)
    await harness.processor(rand=0.0).run_once()
    rows = harness.rows()
    assert [r["status"] for r in rows] == ["published", "failed", "published"]
    failed = rows[1]
    assert failed["attempts"] == 1
    assert failed["last_error"] == "refused (2,)"
    due = datetime.strptime(failed["available_at"], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC)
    waited = (due - before).total_seconds()
    assert 0.8 <= waited <= 0.9  # base_delay 1.0, jitter 0.2, rand 0.0: the low bound


async def test_a_non_retryable_failure_abandons_the_row_at_once(harness: Harness) -> None:
    harness.broker.handler = failing(1, retryable=False)
    await harness.stage(1, 2)
    await harness.processor().drain()
    rows = harness.rows()
    assert [r["status"] for r in rows] == ["abandoned", "published"]
    assert rows[0]["last_error"] == "not retryable: refused (1,)"


async def test_rows_are_abandoned_after_max_attempts(tmp_path: Path) -> None:
    await upgrade("main", DatabaseSettings.model_validate({"url": "sqlite:///outbox.db"}), tmp_path)
    h = Harness(tmp_path, retry={"base_delay": 0.01, "max_delay": 0.01, "max_attempts": 3})
    h.broker.handler = failing(1)
    await h.stage(1)
    processor = h.processor()
    for _ in range(20):
        await processor.run_once()
        await asyncio.sleep(0.02)
    [row] = h.rows()
    assert (row["status"], row["attempts"]) == ("abandoned", 3)
    assert row["last_error"].startswith("gave up after 3 attempts")
    await h.outbox.close()
    await h.store.close()


async def test_a_down_broker_fails_the_batch_with_its_reason(harness: Harness) -> None:
    harness.broker.down = True
    await harness.stage(1, 2)
    await harness.processor().run_once()
    rows = harness.rows()
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all(r["last_error"] == "events: broker is down" for r in rows)


async def test_a_hanging_broker_is_cut_off_by_the_timeouts(harness: Harness) -> None:
    harness.broker.hang = True
    await harness.stage(1)
    started = asyncio.get_running_loop().time()
    await harness.processor().run_once()
    assert asyncio.get_running_loop().time() - started < 2.0
    [row] = harness.rows()
    assert row["status"] == "failed"
    assert "did not answer" in row["last_error"]


async def test_a_failed_row_holds_back_its_stream_but_not_others(harness: Harness) -> None:
    harness.broker.handler = failing(2)
    await harness.stage(1, 2, 3, stream_key="A")
    await harness.stage(10, 11, stream_key="B")
    await harness.processor().drain()
    assert harness.statuses() == ["published", "failed", "pending", "published", "published"]
    assert numbers(harness.broker) == [1, 10, 11]
    untried = harness.rows()[2]
    assert (untried["attempts"], untried["locked_by"]) == (0, None)


async def test_run_wakes_on_new_rows_and_stops_cleanly(harness: Harness) -> None:
    processor = harness.processor()
    task = asyncio.create_task(processor.run())
    await harness.stage(1)
    processor.wake()
    await harness.broker.wait_for(1)
    await harness.stage(2)
    processor.wake()
    await harness.broker.wait_for(2)
    processor.stop()
    await asyncio.wait_for(task, 5)
    assert harness.statuses() == ["published", "published"]


async def test_a_cancelled_batch_is_given_back_with_its_attempt_uncounted(
    harness: Harness,
) -> None:
    harness.broker.hang = True
    await harness.stage(1, 2)
    processor = harness.processor()
    task = asyncio.create_task(processor.run())
    for _ in range(100):
        if harness.statuses() == ["processing", "processing"]:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(r["status"], r["attempts"], r["locked_by"]) for r in harness.rows()] == [
        ("pending", 0, None),
        ("pending", 0, None),
    ]


async def test_an_expired_lease_is_claimed_again_and_the_old_holder_cannot_mark_it(
    harness: Harness,
) -> None:
    from router._store import Marks

    await harness.stage(1)
    first = await harness.store.claim("events", 10, "w1", lease_seconds=0.01)
    await asyncio.sleep(0.05)
    second = await harness.store.claim("events", 10, "w2", lease_seconds=30)
    assert [r.seq for r in second.rows] == [r.seq for r in first.rows]
    await harness.store.mark("events", first.token, Marks(published=[first.rows[0].seq]))
    [row] = harness.rows()
    assert (row["status"], row["locked_by"], row["attempts"]) == ("processing", "w2", 2)
    await harness.store.mark("events", second.token, Marks(published=[second.rows[0].seq]))
    assert harness.statuses() == ["published"]
