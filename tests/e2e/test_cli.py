"""The router command's init-db and check, run as a user runs them."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import yaml

from router import Outbox
from router.ops.migrate import head_revision
from tests.conftest import NATS_URL, PgDatabases, make_config, pg_fetch
from tests.e2e.helpers import ROOT, router
from tests.integration.events import OrderPlaced
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
    assert "1 of 4 checks failed" in result.stdout  # the database, its wake-up, two brokers


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
    assert "4 of 11 checks failed" in result.stdout  # with the database's wake-up
    assert result.returncode == 1


UNKNOWN_NAMES = [
    ("requeue", "--target", "nope"),
    ("requeue", "--target", "events", "--target", "nope"),
    ("requeue", "--database", "nope"),
    ("requeue", "--group", "g1", "--database", "nope"),
    ("groups", "--target", "nope"),
    ("groups", "--database", "nope"),
    ("discard", "--group", "g1", "--database", "nope"),
    ("pause", "nope"),
    ("resume", "nope"),
    ("pause", "events", "--database", "nope"),
    ("status", "--database", "nope"),
    ("cleanup", "--database", "nope"),
    ("audit", "--database", "nope"),
    ("replay", "--target", "nope"),
    ("replay", "--target", "events", "--database", "nope"),
    ("init-db", "--database", "nope"),
    ("preview", "order_placed", "--target", "nope"),
    ("preview", "order_placed", "--database", "nope"),
]


async def test_an_unknown_target_or_database_is_one_line_naming_the_known_ones(
    pg_databases: PgDatabases, tmp_path: Path
) -> None:
    url = await pg_databases.new()
    write_config(
        tmp_path,
        {"main": url},
        {"events": nats(NATS_URL, internal=True), "partner": nats(NATS_URL)},
    )
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    config["events"] = ["tests.integration.events"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    # Side by side: each is a process start (a second or more), and none of them writes.
    results = await asyncio.gather(
        *(
            asyncio.to_thread(router, *command, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
            for command in UNKNOWN_NAMES
        )
    )
    for command, result in zip(UNKNOWN_NAMES, results, strict=True):
        lines = result.stderr.splitlines()
        assert (result.returncode, result.stdout, len(lines)) == (2, "", 1), (command, result)
        assert lines[0].startswith("router: "), (command, lines)
        known = ("main",) if "--database" in command else ("events", "partner")
        assert all(name in lines[0] for name in known), (command, lines)
    shown = router("requeue", "--target", "nope", cwd=tmp_path)
    assert shown.stderr == "router: unknown target 'nope'; configured: ['events', 'partner']\n"
    assert await pg_fetch(url, "SELECT * FROM router_audit") == []  # nothing was done


async def test_trace_takes_a_prefix_and_refuses_what_is_not_an_id(
    pg_databases: PgDatabases, tmp_path: Path
) -> None:
    url = await pg_databases.new()
    brokers: dict[str, object] = {"events": nats(NATS_URL, internal=True)}
    write_config(tmp_path, {"main": url}, brokers)
    outbox = Outbox(make_config({"main": url}, brokers))
    async with outbox.transaction() as tx:
        await tx.stage(OrderPlaced(order_id="o-1", total=Decimal(1)))
        await tx.stage(OrderPlaced(order_id="o-2", total=Decimal(2)))
    await outbox.close()
    # Two ids with the same first 8 digits, as two events of one minute have (UUIDv7).
    first, second = "01a21902-0000-7000-8000-00000000000a", "01a21902-0000-7000-8000-00000000000b"
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "UPDATE router_outbox SET message_id = (CASE WHEN seq = (SELECT min(seq) FROM "
            "router_outbox) THEN $1 ELSE $2 END)::uuid",
            first,
            second,
        )
    finally:
        await conn.close()

    ambiguous = router("trace", "01a21902", cwd=tmp_path)
    assert (ambiguous.returncode, ambiguous.stdout) == (2, "")
    assert ambiguous.stderr.splitlines() == [
        "router: 01a21902 matches 2 events; give more of the id:",
        f"  {first}",
        f"  {second}",
    ]
    for given in (second, second.replace("-", ""), second.upper()):
        found = router("trace", given, cwd=tmp_path)
        assert found.returncode == 0, found.stderr
        assert found.stdout.splitlines()[0] == f"message {second} (order_placed)"
    for wrong in ("not-a-uuid", "01a2190", f"{second}0"):
        refused = router("trace", wrong, cwd=tmp_path)
        assert (refused.returncode, refused.stdout) == (2, "")
        assert refused.stderr == (
            f"router: {wrong!r} is not a message id (32 hex digits, dashes optional) nor its "
            "first 8 digits or more\n"
        )
    missing = router("trace", "ffffffff", cwd=tmp_path)
    assert (missing.returncode, missing.stdout) == (1, "no outbox row has message id ffffffff\n")
