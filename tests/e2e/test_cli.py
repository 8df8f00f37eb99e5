"""The router command's init-db and check, run as a user runs them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import yaml

from router.ops.migrate import head_revision
from tests.conftest import NATS_URL, PgDatabases
from tests.e2e.helpers import router
from tests.services import NATS, free_port, require

SECRET = "s3cr3t-Pa55"

HEAD = head_revision()


def write_config(folder: Path, databases: dict[str, str], brokers: dict[str, object]) -> None:
    (folder / "config.yaml").write_text(
        yaml.safe_dump({"service": "shop", "databases": databases, "brokers": brokers})
    )


def nats(url: str, **extra: object) -> dict[str, object]:
    return {
        "type": "nats",
        "url": url,
        "destination": "clitest.{event_type}",
        "stream": {"name": "CLITEST", "subjects": ["clitest.>"], "storage": "memory"},
        **extra,
    }


async def schema(url: str) -> list[tuple[str, str]]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT 'column', column_name || ' ' || data_type FROM information_schema.columns "
            "WHERE table_name = 'router_outbox' UNION ALL "
            # The outbox's partitions hold its indexes (migration 0011).
            "SELECT 'index', indexdef FROM pg_indexes WHERE tablename LIKE 'router_outbox%' "
            "UNION ALL SELECT 'version', version_num FROM router_alembic_version ORDER BY 1, 2"
        )
    finally:
        await conn.close()
    return [(r[0], r[1]) for r in rows]


async def test_init_db_twice_on_postgresql_changes_nothing(
    pg_databases: PgDatabases, tmp_path: Path
) -> None:
    url = await pg_databases.new(migrated=False)
    with_password = url.replace("postgres@", f"postgres:{SECRET}@")  # trust auth ignores it
    write_config(tmp_path, {"main": with_password}, {"events": nats(NATS_URL, internal=True)})

    first = router("init-db", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(f"main: upgraded empty -> {HEAD}")
    created = await schema(url)
    assert ("version", HEAD) in created
    assert any("ix_router_outbox_claim" in text for _, text in created)

    second = router("init-db", cwd=tmp_path)
    assert second.returncode == 0
    assert f"main: already at {HEAD}, nothing to do" in second.stdout
    assert await schema(url) == created
    assert SECRET not in first.stdout + first.stderr + second.stdout + second.stderr


async def test_check_names_the_failing_broker_and_why_without_secrets(
    pg_databases: PgDatabases, tmp_path: Path
) -> None:
    require("NATS", NATS)
    url = await pg_databases.new()
    dead = f"nats://admin:{SECRET}@127.0.0.1:{free_port()}"
    write_config(
        tmp_path,
        {"main": url.replace("postgres@", f"postgres:{SECRET}@")},
        {"events": nats(NATS_URL, internal=True), "partner": nats(dead)},
    )
    result = router("check", cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1
    assert SECRET not in output
    lines = {
        line.split()[1]: line
        for line in result.stdout.splitlines()[1:]
        if line.strip() and line.split()[0] in ("database", "broker")
    }
    assert "ok" in lines["main"].split()
    assert "ok" in lines["events"].split()
    assert "FAILED" in lines["partner"]
    assert "ConnectionRefusedError" in lines["partner"]
    assert "nats://***@127.0.0.1" in lines["partner"]
    assert "1 of 3 checks failed" in result.stdout


async def test_check_reports_a_missing_outbox_table(
    pg_databases: PgDatabases, tmp_path: Path
) -> None:
    url = await pg_databases.new(migrated=False)
    write_config(tmp_path, {"main": url}, {"events": nats(NATS_URL, internal=True)})
    result = router("check", cwd=tmp_path)
    assert result.returncode == 1
    assert "outbox table is missing; run 'router init-db'" in result.stdout


def test_invalid_config_names_the_path_and_exits_2(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(
        "databases:\n  main: sqlite:///x.db\nbrokers:\n  events:\n    type: nats\n"
        f"    url: nats://u:{SECRET}@h:1\n    internal: yes\n    stream: {{name: 'bad name', "
        "subjects: ['a.>']}\n    batch: 3\n"
    )
    result = router("check", cwd=tmp_path)
    assert result.returncode == 2
    assert "brokers.events.stream.name: String should match pattern" in result.stderr
    assert "brokers.events.batch: unknown key" in result.stderr
    assert SECRET not in result.stderr


def test_broken_yaml_names_line_and_column(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("databases:\n  main: [unclosed\n")
    result = router("init-db", cwd=tmp_path)
    assert result.returncode == 2
    assert "config.yaml: invalid YAML at line 3, column 1" in result.stderr


async def test_check_covers_every_broker_type_and_hides_every_kind_of_secret(
    pg_databases: PgDatabases, tmp_path: Path, kafka_peer: str, servicebus_peer: Any
) -> None:
    require("NATS", NATS)
    url = await pg_databases.new()
    good_bus = servicebus_peer.connection_string.replace(
        "SharedAccessKey=y", f"SharedAccessKey={SECRET}"
    )
    dead_port = free_port()
    brokers: dict[str, object] = {
        "events": nats(NATS_URL, internal=True),
        "kafka": {
            "type": "kafka",
            "bootstrap_servers": kafka_peer,
            "idempotent": False,
            "destination": "clitest.{event_type}",
        },
        "rabbit": {
            "type": "rabbitmq",
            "url": "amqp://guest:guest@127.0.0.1:5672/",
            "exchange": {"name": "clitest", "durable": False},
        },
        "redis": {"type": "redis", "url": "redis://127.0.0.1:6379/0"},
        "bus": {
            "type": "servicebus",
            "connection_string": good_bus,
            "destination": "clitest-orders",
        },
        "dead_rabbit": {
            "type": "rabbitmq",
            "url": f"amqp://app:{SECRET}@127.0.0.1:{dead_port}/",
            "exchange": {"name": "clitest"},
            "connect_timeout": 1,
        },
        "dead_redis": {
            "type": "redis",
            "url": f"redis://:{SECRET}@127.0.0.1:{dead_port}/0",
            "connect_timeout": 1,
        },
        "dead_kafka": {
            "type": "kafka",
            "bootstrap_servers": f"127.0.0.1:{dead_port}",
            "sasl": {"username": "app", "password": SECRET},
            "connect_timeout": 1,
        },
        "dead_bus": {
            "type": "servicebus",
            "connect_timeout": 2,
            "destination": "orders",
            "connection_string": good_bus.replace(f":{servicebus_peer.port};", f":{dead_port};"),
        },
    }
    write_config(tmp_path, {"main": url}, brokers)
    result = router("check", cwd=tmp_path, timeout=120)
    output = result.stdout + result.stderr
    assert SECRET not in output
    lines = {
        line.split()[1]: line
        for line in result.stdout.splitlines()[1:]
        if line.split() and line.split()[0] in ("database", "broker")
    }
    for name in ("main", "events", "kafka", "rabbit", "redis", "bus"):
        assert " ok " in lines[name], lines[name]
    for name in ("dead_rabbit", "dead_redis", "dead_kafka", "dead_bus"):
        assert "FAILED" in lines[name], lines[name]
    assert "rabbitmq amqp://***@127.0.0.1" in lines["dead_rabbit"]
    assert "4 of 10 checks failed" in result.stdout
    assert result.returncode == 1
