"""The lease heartbeat: a batch that takes longer to publish than ``lease_seconds`` keeps its
rows, so no other worker publishes them again (every database); a batch whose rows were taken
over sends no further wave (SQLite and MariaDB: a worker taken for dead; PostgreSQL: the
session that held the batch ended); ``extend`` holds only the rows still under a claim's token
(SQLite and MariaDB, where a lease is written on the rows; PostgreSQL holds them in the claim's
transaction, tests/integration/test_held_batches.py)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from decimal import Decimal

import pytest

from brokers import MemoryBroker, OutgoingMessage, PublishResult
from router import Outbox, Processor, RouterConfig
from router.relay.store import BatchLost, Marks, OutboxStore, new_token, open_store
from tests.conftest import make_config
from tests.integration.events import OrderPlaced
from tests.integration.test_write_path import Database, database  # noqa: F401 (fixture)

FIRST, SECOND = "host:w1:101:first0", "host:w2:102:second"

# A wave's publish is bounded by connect_timeout + publish_timeout + 1 = 2.5 s, so the
# processor extends a lease with less than 3.5 s left, to 4.5 s: far past lease_seconds.
BROKERS = {
    "events": {"type": "memory", "internal": True, "connect_timeout": 0.5, "publish_timeout": 1}
}


def config_of(database: Database, lease_seconds: float = 1) -> RouterConfig:  # noqa: F811
    return make_config(
        {"main": database.url},
        BROKERS,
        base_dir=database.base_dir,
        outbox={"lease_seconds": lease_seconds, "batch_size": 100},
    )


def store_of(config: RouterConfig) -> OutboxStore:
    return open_store("main", config.databases["main"], config.base_dir)


async def stage(config: RouterConfig, count: int, streams: int = 1) -> list[str]:
    """``count`` events over ``streams`` stream keys, in turn; returns their ids."""
    outbox = Outbox(config)
    try:
        async with outbox.transaction() as tx:
            return await tx.stage(
                *(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(count)),
                stream_keys=[f"stream-{i % streams}" for i in range(count)],
            )
    finally:
        await outbox.close()


class SlowBroker(MemoryBroker):
    """A memory broker whose every publish (one wave) takes ``seconds``, after ``during``
    (given the wave's number, from 0) has run."""

    def __init__(
        self, seconds: float, during: Callable[[int], Awaitable[None]] | None = None
    ) -> None:
        super().__init__("events")
        self.seconds = seconds
        self.during = during
        self.waves: list[list[str]] = []

    async def publish(self, batch: Sequence[OutgoingMessage]) -> list[PublishResult]:
        """Wait, then acknowledge the wave like the memory broker."""
        wave = len(self.waves)
        self.waves.append([m.wire.message_id for m in batch])
        if self.during is not None:
            await self.during(wave)
        await asyncio.sleep(self.seconds)
        return await super().publish(batch)


def processor(
    config: RouterConfig, store: OutboxStore, broker: SlowBroker, worker: str
) -> Processor:
    return Processor(
        database="main",
        target="events",
        settings=config.brokers["events"],
        broker=broker,
        store=store,
        outbox=config.outbox,
        worker_id=worker,
    )


async def held(database: Database) -> list[tuple[str, str | None, int]]:  # noqa: F811
    rows = await database.fetch(
        "SELECT status, locked_by, attempts FROM router_outbox ORDER BY seq"
    )
    return [(r["status"], r["locked_by"], r["attempts"]) for r in rows]


LEASED = pytest.mark.parametrize("database", ["sqlite", "mysql"], indirect=True)


@LEASED
async def test_extend_holds_only_the_rows_under_the_token_and_counts_them(
    database: Database,  # noqa: F811
) -> None:
    config = config_of(database)
    await stage(config, 6, streams=6)  # no row waits for another
    store = store_of(config)
    try:
        short = await store.claim("events", 2, FIRST, 1)
        long = await store.claim("events", 2, SECOND, 100)
        assert (len(short), len(long)) == (2, 2)

        assert await store.extend("events", short.token, 200) == 2
        # The earliest lease end is now the other claim's: the short one moved past it, and
        # the other did not move.
        due = await store.next_due("events")
        assert due is not None and 90 < due <= 100

        # A token no claim has, and a claim's token under another target's name: nothing.
        assert await store.extend("events", new_token(), 200) == 0
        assert await store.extend("partner", short.token, 200) == 0

        # A marked row is no longer held.
        await store.mark("events", short.token, Marks(published=[short.rows[0].seq]))
        assert await store.extend("events", short.token, 200) == 1

        # A stale token: its lease ran out and another claim took the rows over.
        stale = await store.claim("events", 2, FIRST, 0.05)
        await asyncio.sleep(0.2)
        fresh = await store.claim("events", 10, SECOND, 100)
        assert [r.seq for r in fresh.rows] == [r.seq for r in stale.rows]
        assert await store.extend("events", stale.token, 200) == 0
        assert [status for status, _, _ in await held(database)] == [
            *["published", "processing"],
            *["processing"] * 4,
        ]
    finally:
        await store.close()


async def test_a_batch_whose_publish_outlasts_the_configured_lease_is_not_published_twice(
    database: Database,  # noqa: F811
) -> None:
    # lease_seconds 1, and a batch of 6 waves (12 rows over 2 streams) at 0.4 s a wave: the
    # batch outlives its configured lease, while a second worker keeps trying to claim.
    config = config_of(database, lease_seconds=1)
    ids = await stage(config, 12, streams=2)
    store = store_of(config)
    broker = SlowBroker(0.4)
    first, second = (processor(config, store, broker, w) for w in (FIRST, SECOND))
    try:
        delivering = asyncio.create_task(first.run_once())
        async with asyncio.timeout(10):
            while not broker.waves:  # the first worker holds the batch
                await asyncio.sleep(0.01)
            while not delivering.done():
                await second.run_once()
                await asyncio.sleep(0.05)
        assert await delivering == 12
        assert await second.drain() == 0

        assert Counter(broker.ids()) == Counter(ids)  # each once
        assert len(broker.waves) == 6
        assert await held(database) == [("published", None, 1)] * 12
    finally:
        await store.close()


@LEASED
async def test_a_claim_whose_rows_were_taken_over_sends_no_further_wave(
    database: Database,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = config_of(database, lease_seconds=1)
    await stage(config, 6, streams=2)
    store = store_of(config)

    async def taken_over(wave: int) -> None:
        # During the first wave the worker is taken for dead (a --workers parent gives its
        # leases back) and another worker claims the rows.
        if wave == 0:
            assert await store.release_worker(FIRST) == 6
            assert len(await store.claim("events", 10, SECOND, 30)) == 6

    # 1.2 s a wave: after the first, less than 3.5 s of the 4.5 s extension is left, so the
    # lease is extended again before the second wave, which finds the rows gone.
    broker = SlowBroker(1.2, during=taken_over)
    try:
        with caplog.at_level(logging.WARNING, logger="router.relay.lease"):
            assert await processor(config, store, broker, FIRST).run_once() == 6

        assert len(broker.waves) == 1  # the first wave, one row of each stream, and no more
        assert len(broker.ids()) == 2
        # Its marks and its release of the rest were fenced: the other claim holds every row.
        assert await held(database) == [("processing", SECOND, 1)] * 6
        [lost] = [r for r in caplog.records if r.getMessage() == "batch.lease_lost"]
        assert (lost.rows, lost.held, lost.error) == (6, 0, None)  # type: ignore[attr-defined]
    finally:
        await store.close()


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
async def test_a_batch_whose_session_ended_sends_no_further_wave(
    database: Database,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = config_of(database, lease_seconds=1)
    await stage(config, 6, streams=2)
    store = store_of(config)
    other = store_of(config)

    async def session_ends(wave: int) -> None:
        # During the first wave the batch's session goes (the server restarts it, or an
        # operator kills it): its rows are queued again at once, and another worker claims them.
        if wave == 0:
            await database.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_locks"
                " WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()"
                # This database's only: another test may hold advisory locks meanwhile.
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            assert len(await other.claim("events", 10, SECOND, 30)) == 6

    # As above: the lease is extended before the second wave, which finds the session gone.
    broker = SlowBroker(1.2, during=session_ends)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="router.relay.lease"),
            pytest.raises(BatchLost),
        ):
            await processor(config, store, broker, FIRST).run_once()

        assert len(broker.waves) == 1  # the first wave, one row of each stream, and no more
        assert len(broker.ids()) == 2
        [lost] = [r for r in caplog.records if r.getMessage() == "batch.lease_lost"]
        # The run's heartbeat found the session gone first: none of its rows is held.
        assert (lost.rows, lost.held) == (6, 0)  # type: ignore[attr-defined]
        # Nothing of the first batch was written: the other worker holds every row, queued.
        assert await held(database) == [("pending", None, 0)] * 6
    finally:
        await store.close()
        await other.close()
