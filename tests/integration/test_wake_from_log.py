"""The relay wakes from PostgreSQL's own log (``wakeup: log``), on a private cluster with
``wal_level = logical``: events another process commits, without any NOTIFY, arrive within
50 ms of their commit though the relay would poll only once an hour; its temporary slot lives
as long as the relay; a lost replication connection falls back to LISTEN at once and comes
back. And ``auto`` on the shared server (``wal_level = replica``) says why it cannot."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from brokers import Broker, BrokerSettings, MemoryBroker, OutgoingMessage, PublishResult
from router import Runner
from router.relay.store.postgres import PostgresStore
from router.relay.store.postgres_wal import SLOT_PREFIX
from tests.conftest import make_config, pg_fetch
from tests.integration.test_delivery import wait_until

LATENCY = 0.050  # seconds from the writer's commit to the broker's publish
GAPS = (1.0, 3.0)  # idle seconds before each event
SLOTS = "SELECT slot_name, temporary, active FROM pg_replication_slots WHERE slot_name LIKE $1"


class Stager:
    """tests/integration/stager_process.py, running: ``stage()`` commits one event and
    returns its id and commit time. No NOTIFY goes with it unless a relay idles listening
    (holding its wake lock): a relay that follows the log holds none."""

    def __init__(self, url: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.stager_process", url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "ready"

    async def stage(self) -> tuple[str, float]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("stage\n")
        self.process.stdin.flush()
        line = json.loads(await asyncio.to_thread(self.process.stdout.readline))
        return line["id"], float(line["committed"])

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def stager(log_url: str) -> Iterator[Stager]:
    running = Stager(log_url)
    yield running
    running.close()


@pytest.fixture
def stager_5432(pg_url: str) -> Iterator[Stager]:
    running = Stager(pg_url)
    yield running
    running.close()


class Arrivals:
    """When each message reached the in-memory broker, by message id (wall clock)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    def __call__(self, message: OutgoingMessage) -> PublishResult | None:
        self.at[message.wire.message_id] = time.time()
        return None

    async def latency(self, message_id: str, committed: float, timeout: float = 5.0) -> float:
        await wait_until(self._arrived(message_id), timeout=timeout)
        return self.at[message_id] - committed

    def _arrived(self, message_id: str) -> Any:
        async def arrived() -> bool:
            return message_id in self.at

        return arrived


@asynccontextmanager
async def relay(url: str, arrivals: Arrivals, wakeup: str = "log") -> AsyncIterator[Runner]:
    """A relay on ``url`` that would poll once an hour, publishing to a memory broker."""
    config = make_config(
        {"main": {"url": url, "wakeup": wakeup}},
        {"events": {"type": "memory", "internal": True}},
        outbox={"poll_interval": 3600},
    )

    def factory(name: str, settings: BrokerSettings) -> Broker:
        return MemoryBroker(name, handler=arrivals)

    runner = Runner(config, broker_factory=factory, serve_http=False, run_cleanup=False)
    await runner.start()
    try:
        yield runner
    finally:
        await runner.shutdown()


def store_of(runner: Runner) -> PostgresStore:
    store = runner.stores["main"]
    assert isinstance(store, PostgresStore)
    return store


async def following(runner: Runner, timeout: float = 10.0, *, not_slot: str = "") -> None:
    """Wait until the relay follows the log (through another slot than ``not_slot``)."""

    async def on_log() -> bool:
        mechanism, reason = store_of(runner).wakeup
        return mechanism == "log" and reason != f"slot {not_slot}"

    await wait_until(on_log, timeout=timeout)


async def test_commits_of_another_process_wake_the_relay_from_the_log_within_50ms(
    log_url: str, stager: Stager
) -> None:
    arrivals = Arrivals()
    notified: list[str] = []
    listener = await asyncpg.connect(log_url)
    await listener.add_listener("router_outbox", lambda *args: notified.append(args[3]))
    try:
        async with relay(log_url, arrivals) as runner:
            await following(runner)
            slots = await pg_fetch(log_url, SLOTS, SLOT_PREFIX + "%")
            assert [(r["temporary"], r["active"]) for r in slots] == [(True, True)]
            latencies = []
            for gap in GAPS:
                await asyncio.sleep(gap)
                message_id, committed = await stager.stage()
                latencies.append(await arrivals.latency(message_id, committed))
            print("latency after idle gaps", dict(zip(GAPS, latencies, strict=True)))
            assert max(latencies) < LATENCY, latencies
        assert notified == []  # only the log told the relay
    finally:
        await listener.close()

    async def no_slot() -> bool:
        return not await pg_fetch(log_url, SLOTS, SLOT_PREFIX + "%")

    await wait_until(no_slot, timeout=5)


async def test_a_lost_replication_connection_falls_back_at_once_and_comes_back(
    log_url: str, stager: Stager
) -> None:
    arrivals = Arrivals()
    async with relay(log_url, arrivals) as runner:
        await following(runner)
        [first] = await pg_fetch(log_url, SLOTS, SLOT_PREFIX + "%")
        await pg_fetch(log_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_replication")
        message_id, committed = await stager.stage()
        fallback = await arrivals.latency(message_id, committed)

        await following(runner, not_slot=first["slot_name"])
        [second] = await pg_fetch(log_url, SLOTS, SLOT_PREFIX + "%")
        assert second["slot_name"] != first["slot_name"] and second["temporary"]
        message_id, committed = await stager.stage()
        back = await arrivals.latency(message_id, committed)
        print(f"latency: on LISTEN {fallback * 1000:.1f} ms, on the log again {back * 1000:.1f} ms")
        assert fallback < 1.0 and back < LATENCY, (fallback, back)


async def test_auto_without_logical_decoding_falls_back_and_names_wal_level(pg_url: str) -> None:
    async with relay(pg_url, Arrivals(), wakeup="auto") as runner:
        mechanism, reason = await decided(runner)
    assert mechanism == "notify"
    assert "wal_level is replica: set wal_level = logical" in reason


async def decided(runner: Runner) -> tuple[str, str]:
    """The wake-up the relay settled on, once its watcher chose."""
    store = store_of(runner)

    async def chosen() -> bool:
        return store.wakeup[0] != "starting"

    await wait_until(chosen)
    return store.wakeup


async def test_auto_without_the_publication_falls_back_and_says_to_run_init_db(
    log_url: str,
) -> None:
    await pg_fetch(log_url, "DROP PUBLICATION router_wakeup")
    async with relay(log_url, Arrivals(), wakeup="auto") as runner:
        mechanism, reason = await decided(runner)
    assert mechanism == "notify"
    assert reason == "publication router_wakeup is missing: run `router init-db`"


async def test_log_asked_of_a_server_without_it_still_delivers_by_listen(
    pg_url: str, stager_5432: Stager
) -> None:
    arrivals = Arrivals()
    async with relay(pg_url, arrivals, wakeup="log") as runner:
        mechanism, reason = await decided(runner)
        assert mechanism == "notify" and "wal_level is replica" in reason
        message_id, committed = await stager_5432.stage()
        assert await arrivals.latency(message_id, committed) < 1.0
