"""Every wake-up mechanism, under writers that commit at random moments from processes of
their own while the relay goes idle, wakes, works and goes idle again: every committed event
arrives within a second of its commit, though the relay would poll only once an hour.

PostgreSQL by idle-only NOTIFY (the shared server), by its log (a private server with
``wal_level = logical``) and by the poll (the shared server); MariaDB by its binlog (a private server with it on) and by the poll
(the shared server); SQLite by its WAL file. The idle-only NOTIFY and MariaDB's poll also with
``outbox.linger``, under which a relay claims again after a short batch rather than go idle."""

from __future__ import annotations

import random
from pathlib import Path

from router.config import DatabaseSettings
from router.ops.migrate import upgrade
from tests.integration.wake_relay import Relay


def random_plan(seed: int, writers: int = 4, events: int = 30) -> list[list[float]]:
    """Per writer, the seconds before each event: bursts of quick commits (the relay busy)
    between idle gaps of up to a second (the relay idle, going idle, or waking)."""
    rand = random.Random(seed)
    return [
        [rand.choice((0.0, 0.002, 0.01, 0.05, rand.uniform(0.1, 1.0))) for _ in range(events)]
        for _ in range(writers)
    ]


async def all_within_a_second(relay: Relay, mechanism: str, seed: int) -> None:
    """The relay settles on ``mechanism``; a random plan's every event arrives in time."""
    await relay.runner.start()
    try:
        assert await relay.settled() == mechanism, relay.store.wakeup
        committed = await relay.stage_elsewhere(random_plan(seed))
        lateness = await relay.lateness(committed, within=3.0)
    finally:
        await relay.runner.shutdown()
    assert len(lateness) == 120
    assert max(lateness) < 1.0, sorted(lateness)[-5:]


async def test_postgresql_idle_only_notify(pg_url: str, tmp_path: Path) -> None:
    await all_within_a_second(Relay(pg_url, tmp_path), "notify", seed=1)


async def test_postgresql_idle_only_notify_with_a_linger(pg_url: str, tmp_path: Path) -> None:
    # Lingering, the relay holds no wake lock, so the stagers notify no one: the claim after
    # the linger must find their rows, and the relay must go idle (and be notified) after.
    await all_within_a_second(Relay(pg_url, tmp_path, linger=0.002), "notify", seed=6)


async def test_postgresql_log(log_url: str, tmp_path: Path) -> None:
    await all_within_a_second(Relay(log_url, tmp_path, wakeup="log"), "log", seed=2)


async def test_postgresql_poll(pg_url: str, tmp_path: Path) -> None:
    await all_within_a_second(Relay(pg_url, tmp_path, wakeup="poll"), "poll", seed=5)


async def test_mariadb_binlog(binlog_url: str, tmp_path: Path) -> None:
    await all_within_a_second(Relay(binlog_url, tmp_path, wakeup="log"), "log", seed=3)


async def test_mariadb_poll(mysql_url: str, tmp_path: Path) -> None:
    await all_within_a_second(Relay(mysql_url, tmp_path, wakeup="poll"), "poll", seed=4)


async def test_mariadb_poll_with_a_linger(mysql_url: str, tmp_path: Path) -> None:
    relay = Relay(mysql_url, tmp_path, wakeup="poll", linger=0.002)
    await all_within_a_second(relay, "poll", seed=7)


async def test_sqlite_wal_file(tmp_path: Path) -> None:
    url = "sqlite:///outbox.db"
    await upgrade("main", DatabaseSettings.model_validate({"url": url}), tmp_path)
    await all_within_a_second(Relay(url, tmp_path), "log", seed=5)
