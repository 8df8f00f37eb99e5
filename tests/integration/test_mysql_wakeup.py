"""MariaDB wakes the relay within 200 ms of another process's commit, on every wake-up: the
binlog (a private server with it on), the fast poll (the shared server, binlog off), and
``auto`` picking between them; a cut binlog connection falls back to the poll at once.

The processors' own safety poll (``outbox.poll_interval``) is an hour here, so only the
store's watcher can bring an event in time. The writer is a process of its own
(``tests.integration.stager_process``): no in-process signal helps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from brokers import Broker, BrokerSettings, MemoryBroker, OutgoingMessage, PublishResult
from router import Runner
from router.relay.store.mysql import MysqlStore
from tests.conftest import make_config
from tests.mariadb_binlog import BinlogServer

LATENCY = 0.2  # seconds from the writer's COMMIT to the broker, at most
GAPS = (1.0, 3.0)  # idle seconds before each event
ROOT = Path(__file__).resolve().parents[2]


class Arrivals:
    """A memory broker per target that notes when each order arrived (wall clock)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def factory(self, name: str, settings: BrokerSettings) -> Broker:
        return MemoryBroker(name, handler=self._note)

    def _note(self, message: OutgoingMessage) -> PublishResult | None:
        self.times.setdefault(message.wire.message_id, time.time())
        return None

    async def wait(self, message_id: str, timeout: float = 10.0) -> float:
        """When message ``message_id`` arrived."""
        deadline = time.monotonic() + timeout
        while message_id not in self.times:
            assert time.monotonic() < deadline, f"{message_id} never arrived"
            await asyncio.sleep(0.005)
        return self.times[message_id]


@contextlib.asynccontextmanager
async def relay(url: str, wakeup: str) -> AsyncIterator[tuple[Runner, Arrivals]]:
    """``router serve``'s runner on one database, its safety poll an hour away."""
    config = make_config(
        {"main": {"url": url, "wakeup": wakeup}},
        {"events": {"type": "memory", "internal": True}},
        outbox={"poll_interval": 3600},
    )
    arrivals = Arrivals()
    runner = Runner(
        config,
        broker_factory=arrivals.factory,
        start_embedded=False,
        serve_http=False,
        run_cleanup=False,
    )
    await runner.start()
    try:
        yield runner, arrivals
    finally:
        await runner.shutdown()


class Writer:
    """The writer process (tests/integration/stager_process.py), ready to commit."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def commit(self) -> dict[str, Any]:
        """Commit one event: its message id and when its COMMIT returned."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(b"stage\n")
        await self.process.stdin.drain()
        committed: dict[str, Any] = json.loads(
            await asyncio.wait_for(self.process.stdout.readline(), 30)
        )
        return committed


@contextlib.asynccontextmanager
async def writer(url: str) -> AsyncIterator[Writer]:
    """The writer process, once its imports are done and it is connected."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.integration.stager_process",
        url,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        assert await asyncio.wait_for(process.stdout.readline(), 30) == b"ready\n"
        yield Writer(process)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def latencies(url: str, arrivals: Arrivals, gaps: tuple[float, ...]) -> list[float]:
    """Stage one event after each gap from another process; each one's commit-to-broker time."""
    found = []
    async with writer(url) as process:
        for gap in gaps:
            await asyncio.sleep(gap)
            commit = await process.commit()
            arrived = await arrivals.wait(commit["id"])
            found.append(arrived - commit["committed"])
    return found


def store_of(runner: Runner) -> MysqlStore:
    store = runner.stores["main"]
    assert isinstance(store, MysqlStore)
    return store


async def active(store: MysqlStore, mechanism: str, timeout: float = 10.0) -> None:
    """Wait until the store's watcher reports ``mechanism`` active."""
    deadline = time.monotonic() + timeout
    while store.wakeup.mechanism != mechanism or store.wakeup.reason == "not watching yet":
        assert time.monotonic() < deadline, f"still {store.wakeup}"
        await asyncio.sleep(0.01)


async def arrive_in_time(url: str, wakeup: str, mechanism: str, reason: str) -> None:
    """The relay reports ``mechanism`` (its reason starting with ``reason``), and each event
    arrives within LATENCY."""
    async with relay(url, wakeup) as (runner, arrivals):
        store = store_of(runner)
        await active(store, mechanism)
        assert store.wakeup.reason.startswith(reason), store.wakeup
        found = await latencies(url, arrivals, GAPS)
    print(f"{wakeup} ({mechanism}): " + ", ".join(f"{s * 1000:.0f} ms" for s in found))
    assert max(found) < LATENCY, found


@pytest.mark.parametrize("wakeup", ["log", "auto"])
async def test_the_binlog_brings_an_event_from_another_process_within_200_ms(
    binlog_url: str, wakeup: str
) -> None:
    await arrive_in_time(binlog_url, wakeup, "log", "following the binlog")


@pytest.mark.parametrize(
    ("wakeup", "reason"),
    [
        ("poll", "wakeup: poll"),
        ("auto", "binlog is off: set log_bin and binlog_format=ROW, and GRANT REPLICATION"),
    ],
)
async def test_the_poll_brings_an_event_from_another_process_within_200_ms(
    mysql_url: str, wakeup: str, reason: str
) -> None:
    await arrive_in_time(mysql_url, wakeup, "poll", reason)


async def binlog_dumps(server: BinlogServer) -> list[int]:
    """The ids of the server's binlog dump connections (one per follower)."""
    rows = await asyncio.to_thread(server.execute, "SHOW PROCESSLIST")
    return [int(row[0]) for row in rows if row[4] == "Binlog Dump"]  # type: ignore[call-overload]


async def test_a_cut_binlog_connection_falls_back_to_the_poll_at_once_and_reconnects(
    binlog_url: str, mariadb_binlog: BinlogServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.relay.store.mysql")
    async with relay(binlog_url, "log") as (runner, arrivals):
        store = store_of(runner)
        await active(store, "log")
        # The writer commits 0.4 s after the cut, well before the follower's first reconnect
        # (RECONNECT_FIRST, 1 s after it); then again once the follower is back.
        async with writer(binlog_url) as process:
            before = await binlog_dumps(mariadb_binlog)
            assert before, "no binlog dump connection"
            for thread in before:
                await asyncio.to_thread(mariadb_binlog.execute, f"KILL {thread}")
            found = []
            for gap in (0.4, 2.0):
                await asyncio.sleep(gap)
                commit = await process.commit()
                arrived = await arrivals.wait(commit["id"])
                found.append((commit["committed"], arrived - commit["committed"]))
        after = await binlog_dumps(mariadb_binlog)
        assert store.wakeup.mechanism == "log"
    assert after and not set(after) & set(before), "the follower did not reconnect"
    changes = [
        (r.created, r.getMessage(), getattr(r, "reason", ""))
        for r in caplog.records
        if r.getMessage() in ("wakeup.active", "wakeup.fallback")
    ]
    lost = [t for t, message, reason in changes if reason.startswith("binlog connection lost")]
    back = [t for t, message, _ in changes if message == "wakeup.active" and t > lost[0]]
    (cut_commit, cut_latency), (back_commit, back_latency) = found
    print(f"after the cut: {cut_latency * 1000:.0f} ms; reconnected: {back_latency * 1000:.0f} ms")
    assert lost[0] < cut_commit < back[0] < back_commit, changes  # poll, then binlog again
    assert max(cut_latency, back_latency) < LATENCY, found


async def test_auto_names_the_grant_a_user_without_binlog_privileges_lacks(
    binlog_url: str, mariadb_binlog: BinlogServer
) -> None:
    database = binlog_url.rpartition("/")[2]
    user = f"app_{database[-6:]}"
    for statement in (
        f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'",
        f"GRANT ALL ON `{database}`.* TO '{user}'@'%'",
    ):
        await asyncio.to_thread(mariadb_binlog.execute, statement)
    url = mariadb_binlog.url(database, user, "pw")
    try:
        async with relay(url, "auto") as (runner, arrivals):
            store = store_of(runner)
            await active(store, "poll")
            assert "GRANT REPLICATION SLAVE, REPLICATION CLIENT" in store.wakeup.reason
            assert await store.probe_wakeup() == store.wakeup
            found = await latencies(url, arrivals, (1.0,))
        assert max(found) < LATENCY, found
    finally:
        await asyncio.to_thread(mariadb_binlog.execute, f"DROP USER '{user}'@'%'")
