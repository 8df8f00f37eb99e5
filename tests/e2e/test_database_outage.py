"""What ``router serve`` logs while its database is gone: a line when it goes, one when it is
back, never a traceback per retry."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import asyncpg
import yaml

from tests.conftest import NATS_URL, PG_ADMIN, PgDatabases
from tests.e2e.helpers import Serving
from tests.services import NATS, require


async def admin(statement: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


async def test_a_dropped_database_is_logged_once_and_its_return_once(
    pg_databases: PgDatabases, tmp_path: Path
) -> None:
    require("NATS", NATS)
    url = await pg_databases.new()
    name = url.rsplit("/", 1)[1]
    broker = {
        "type": "nats",
        "url": NATS_URL,
        "internal": True,
        "destination": "outage.{event_type}",
        "stream": {"name": "OUTAGE", "subjects": ["outage.>"], "storage": "memory"},
    }
    config = {
        "service": "shop",
        "databases": {"main": url},
        "brokers": {"events": broker},
        # Polls often, so the processor retries as well as the LISTEN connection.
        "outbox": {"poll_interval": 0.2},
        "http": {"enabled": False},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    serving = Serving(tmp_path)
    try:
        await asyncio.to_thread(serving.wait_for, "router.started")
        await admin(f'DROP DATABASE "{name}" WITH (FORCE)')
        await asyncio.sleep(6)  # the processor and the listener retry several times each
        await admin(f'CREATE DATABASE "{name}" TEMPLATE "{pg_databases.template}"')
        await asyncio.to_thread(serving.wait_for, "db.recovered")
        await asyncio.sleep(1)
    finally:
        code = await asyncio.to_thread(serving.stop, signal.SIGTERM)
    log = serving.log.read_text()
    assert code == 0, log
    assert "Traceback" not in log, log
    [down] = [line for line in log.splitlines() if " db.unavailable " in line]
    assert "WARNING db.unavailable database=main error=" in down
    # The reason the first failure gave: the server ended the session, or no such database.
    assert "terminating connection" in down or f'\\"{name}\\" does not exist' in down
    assert "DETAIL" not in down
    [back] = [line for line in log.splitlines() if " db.recovered " in line]
    assert "INFO    db.recovered database=main after=" in back
