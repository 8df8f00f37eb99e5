"""Which wake-up each database's relay uses, as a user sees it: ``router check`` and
``router status`` name what a relay starting now would pick (a read-only probe) and what to
change to have the database's log; the console's /api/outbox names what the running relay
uses. The shared PostgreSQL has ``wal_level = replica`` and the shared MariaDB no binlog, so
both fall back; SQLite always watches its WAL file."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import MEMORY_BROKERS, Database, make_config
from tests.e2e.helpers import router
from tests.services import free_port

PASSWORD = "wake-s3cret-pw"  # the shared server trusts loopback: the password is not checked
WAL_ADVICE = "wal_level is replica: set wal_level = logical (takes a server restart)"
BINLOG_ADVICE = (
    "binlog is off: set log_bin and binlog_format=ROW, and GRANT REPLICATION SLAVE, "
    "REPLICATION CLIENT ON *.* TO the router's user"
)
SQLITE_WATCHER = "log: its WAL file, looked at every 50 ms"


def with_password(pg_url: str) -> str:
    return pg_url.replace("postgres@", f"postgres:{PASSWORD}@", 1)


def write_config(folder: Path, databases: dict[str, Any]) -> None:
    config = {
        "databases": databases,
        "brokers": {"events": {"type": "memory", "internal": True}},
        "http": {"enabled": False},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


def wakeup_lines(stdout: str) -> dict[str, str]:
    """``router check``'s wake-up lines by database, columns after the name."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("wake-up"):
            _, name, rest = line.split(maxsplit=2)
            found[name] = rest
    return found


async def test_check_names_the_wakeup_each_database_would_use_and_what_to_change(
    pg_url: str, mysql_url: str, tmp_path: Path
) -> None:
    write_config(
        tmp_path,
        {"pg": with_password(pg_url), "maria": mysql_url, "lite": "sqlite:///./lite.db"},
    )
    assert (
        await asyncio.to_thread(router, "init-db", "--database", "lite", cwd=tmp_path)
    ).returncode == 0

    result = await asyncio.to_thread(router, "check", cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    assert wakeup_lines(result.stdout) == {
        "pg": f"ok      wakeup: auto  notify, not the log: {WAL_ADVICE}",
        "maria": f"ok      wakeup: auto  poll, not the log: {BINLOG_ADVICE}",
        "lite": f"ok      wakeup: auto  {SQLITE_WATCHER}",
    }
    # Each database's wake-up line follows its own line.
    lines = result.stdout.splitlines()
    pg_line = next(i for i, line in enumerate(lines) if line.startswith("database  pg"))
    assert lines[pg_line + 1].startswith("wake-up   pg")
    assert PASSWORD not in result.stdout + result.stderr


async def test_check_says_poll_as_configured_and_warns_when_the_log_asked_for_is_impossible(
    pg_url: str, tmp_path: Path
) -> None:
    write_config(
        tmp_path,
        {
            "polled": {"url": with_password(pg_url), "wakeup": "poll"},
            "logged": {"url": with_password(pg_url), "wakeup": "log"},
        },
    )

    result = await asyncio.to_thread(router, "check", cwd=tmp_path)

    # The relay delivers all the same on the fallback: a warning, not a failed check.
    assert result.returncode == 0, result.stdout + result.stderr
    assert wakeup_lines(result.stdout) == {
        "polled": "ok      wakeup: poll  poll: as configured; wakeup: auto uses the log where "
        "the server allows it",
        "logged": f"ok      wakeup: log  WARNING: notify until the log works (serve keeps "
        f"trying): {WAL_ADVICE}",
    }
    assert PASSWORD not in result.stdout + result.stderr


async def test_status_shows_the_probed_wakeup_and_labels_it_so(pg_url: str, tmp_path: Path) -> None:
    write_config(tmp_path, {"main": with_password(pg_url)})

    human = await asyncio.to_thread(router, "status", cwd=tmp_path)
    as_json = await asyncio.to_thread(router, "status", "--json", cwd=tmp_path)

    assert human.returncode == 0, human.stderr
    assert human.stdout.rstrip().endswith(
        "wake-up, as a relay starting now would pick it (a running one's: serve's "
        f"/api/outbox):\n  main: notify, not the log: {WAL_ADVICE}"
    )
    assert json.loads(as_json.stdout)["wakeups"] == [
        {
            "database": "main",
            "setting": "auto",
            "mechanism": "notify",
            "reason": WAL_ADVICE,
            "source": "probe",
            "warning": False,
        }
    ]
    assert PASSWORD not in human.stdout + as_json.stdout


@pytest.mark.parametrize("database", ["postgresql", "sqlite"], indirect=True)
async def test_the_console_api_carries_each_databases_active_wakeup(database: Database) -> None:
    from router.serve.runner import Runner

    port = free_port()
    config = make_config(
        {"main": database.url},
        MEMORY_BROKERS,
        database.base_dir,
        http={"bind": f"127.0.0.1:{port}"},
    )
    runner = Runner(config, start_embedded=False, run_cleanup=False)
    await runner.start()
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", trust_env=False
        ) as client:
            deadline = time.monotonic() + 10
            while True:
                [wakeup] = (await client.get("/api/outbox")).json()["wakeups"]
                if wakeup["mechanism"] != "starting" or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
    finally:
        await runner.shutdown()

    expected = {
        "postgresql": {"mechanism": "notify", "reason": WAL_ADVICE},
        "sqlite": {"mechanism": "log", "reason": SQLITE_WATCHER.removeprefix("log: ")},
    }[database.kind]
    assert wakeup == {
        "database": "main",
        "setting": "auto",
        "source": "relay",
        "warning": False,
        **expected,
    }


async def test_a_console_without_a_relay_of_its_own_shows_a_probe(pg_url: str) -> None:
    """The parent of ``--workers N`` runs no relay: its /api/outbox says the wake-up is probed."""
    from prometheus_client import CollectorRegistry

    from router.serve.console import StatusService

    config = make_config({"main": with_password(pg_url)}, MEMORY_BROKERS)
    service = StatusService(config, CollectorRegistry(), dict)

    body = (await service.api()).body.decode()

    assert json.loads(body)["wakeups"] == [
        {
            "database": "main",
            "setting": "auto",
            "mechanism": "notify",
            "reason": WAL_ADVICE,
            "source": "probe",
            "warning": False,
        }
    ]
    assert PASSWORD not in body
