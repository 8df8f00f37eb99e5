"""The router command on a fresh MariaDB database, run as a user runs it: init-db, then status,
pause, resume, requeue, trace and cleanup on an outbox with some history, and what each
prints."""

from __future__ import annotations

import subprocess
from decimal import Decimal
from pathlib import Path

import yaml

from router import Outbox, parse_config
from router.ops.migrate import head_revision
from tests.conftest import MysqlDatabases, mysql_fetch
from tests.e2e.helpers import router
from tests.integration.events import OrderPlaced

HEAD = head_revision()

CONFIG = {
    "service": "shop",
    "brokers": {"events": {"type": "memory", "internal": True}, "partner": {"type": "memory"}},
    "http": {"enabled": False},
}

# What became of both targets' rows of some events, and of the partner's row of others; every
# other row is pending.
HISTORY = {
    "o-0": "status = 'published', published_at = UTC_TIMESTAMP(6) - INTERVAL 10 DAY",
    "o-1": "status = 'published', published_at = UTC_TIMESTAMP(6) - INTERVAL 1 DAY",
}
PARTNER_HISTORY = {
    "o-2": "status = 'abandoned', attempts = 10, last_error = 'connection refused', "
    "last_attempt_at = UTC_TIMESTAMP(6) - INTERVAL 2 DAY",
    "o-3": "status = 'abandoned', attempts = 1, last_error = 'message too large', "
    "last_attempt_at = UTC_TIMESTAMP(6) - INTERVAL 40 DAY",
}


def run(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``router ARGS``, which must succeed without a word on stderr."""
    result = router(*args, cwd=folder)
    assert (result.returncode, result.stderr) == (0, ""), result
    return result


def target_line(status_output: str, target: str) -> list[str]:
    """The columns of ``target``'s line in ``router status``."""
    [line] = [line for line in status_output.splitlines() if line.split()[1:2] == [target]]
    return line.split()


async def stage_history(url: str) -> dict[str, str]:
    """Five events, staged as the application stages them, then given a history; returns
    their message ids by order id."""
    outbox = Outbox(parse_config(yaml.safe_dump({**CONFIG, "databases": {"main": url}})))
    ids: dict[str, str] = {}
    async with outbox.transaction() as tx:
        for i in range(5):
            [ids[f"o-{i}"]] = await tx.stage(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)))
    await outbox.close()
    for order, change in HISTORY.items():
        await mysql_fetch(
            url, f"UPDATE router_outbox SET {change} WHERE message_id = %s", ids[order]
        )
    for order, change in PARTNER_HISTORY.items():
        await mysql_fetch(
            url,
            f"UPDATE router_outbox SET {change} WHERE message_id = %s AND target = 'partner'",
            ids[order],
        )
    await mysql_fetch(
        url,
        "INSERT INTO router_inbox (consumer, message_id, received_at) VALUES "
        "('billing', 'm-1', UTC_TIMESTAMP(6) - INTERVAL 20 DAY), "
        "('billing', 'm-2', UTC_TIMESTAMP(6) - INTERVAL 20 DAY), "
        "('billing', 'm-3', UTC_TIMESTAMP(6))",
    )
    return ids


async def test_the_operations_commands_on_a_fresh_mariadb_database(
    mysql_databases: MysqlDatabases, tmp_path: Path
) -> None:
    url = (await mysql_databases.new(migrated=False)).replace("mysql://", "mariadb://")
    name = url.rpartition("/")[2]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**CONFIG, "databases": {"main": url}}))

    init = router("init-db", cwd=tmp_path)
    assert (init.returncode, init.stderr) == (0, ""), init.stderr
    assert init.stdout == f"main: upgraded empty -> {HEAD} (mariadb://***@127.0.0.1:3306/{name})\n"
    ids = await stage_history(url)

    status = run(tmp_path, "status").stdout
    assert status.startswith(
        "database  target   pending  in flight  retrying  abandoned  published"
    )
    assert target_line(status, "events")[2:7] == ["3", "0", "0", "0", "2"]
    assert target_line(status, "partner")[2:7] == ["1", "0", "0", "2", "2"]
    assert status.endswith(
        "latest errors:\n  main/partner: connection refused\n\n"
        "wake-up, as a relay starting now would pick it (a running one's: serve's /api/outbox):\n"
        "  main: poll, not the log: binlog is off: set log_bin and binlog_format=ROW, and GRANT "
        "REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO the router's user\n"
    )

    assert run(tmp_path, "pause", "partner").stdout == "partner: paused in main\n"
    status = run(tmp_path, "status").stdout
    assert (target_line(status, "events")[-1], target_line(status, "partner")[-1]) == ("no", "yes")
    assert run(tmp_path, "resume", "partner").stdout == "partner: resumed in main\n"
    assert target_line(run(tmp_path, "status").stdout, "partner")[-1] == "no"

    dry = run(tmp_path, "requeue", "--error", "refused", "--dry-run")
    assert dry.stdout == "main: would requeue 1 row(s)\n"
    assert run(tmp_path, "requeue", "--error", "refused").stdout == "main: requeued 1 row(s)\n"
    assert target_line(run(tmp_path, "status").stdout, "partner")[2:7] == ["2", "0", "0", "1", "2"]

    trace = run(tmp_path, "trace", ids["o-2"]).stdout
    assert trace.splitlines()[0] == f"message {ids['o-2']} (order_placed)"
    blocks = {b.splitlines()[0]: b.splitlines()[1:] for b in trace.split("\n\n")[1:]}
    assert {head: [line.split()[-1] for line in lines[:2]] for head, lines in blocks.items()} == {
        "main/events: pending": ["order_placed", "0"],
        "main/partner: pending": ["order_placed", "0"],
    }
    assert blocks["main/partner: pending"][-1].split() == ["last", "error", "connection", "refused"]
    unknown = "01a20000-0000-7000-8000-000000000000"
    missing = router("trace", unknown, cwd=tmp_path)
    assert (missing.returncode, missing.stdout) == (1, f"no outbox row has message id {unknown}\n")

    assert run(tmp_path, "cleanup").stdout == (
        "main: deleted 2 published row(s) older than 7d, 1 abandoned row(s) older than 30d, "
        "2 inbox record(s) older than 14d, 0 gap marker(s) older than 30d\n"
    )
    left = await mysql_fetch(
        url,
        "SELECT target, message_id FROM router_outbox WHERE status IN ('published', 'abandoned')",
    )
    assert sorted((r["target"], r["message_id"]) for r in left) == [
        ("events", ids["o-1"]),
        ("partner", ids["o-1"]),
    ]
    assert await mysql_fetch(url, "SELECT message_id FROM router_inbox") == [{"message_id": "m-3"}]
