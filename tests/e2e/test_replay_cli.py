"""`router replay` as a user runs it (SQLite; tests/integration/test_replay.py runs the same
behaviour on every database against real brokers): a dry run counts, a run answers JSON lines
when its output is not a terminal and leaves an audit trail, a resume of a finished replay
finds nothing left, and mistakes are one line with exit 2."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
import yaml

from router import Outbox
from tests.conftest import Database, make_config
from tests.e2e.helpers import router
from tests.integration.events import OrderPlaced

BROKERS = {"events": {"type": "memory", "internal": True}, "partner": {"type": "memory"}}


def run(database: Database, *args: str, code: int = 0) -> Any:
    result = router(*args, cwd=database.base_dir)
    assert result.returncode == code, result
    return result


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
async def test_replay_from_the_command_line(database: Database) -> None:
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump({"service": "shop", "databases": {"main": database.url}, "brokers": BROKERS})
    )
    outbox = Outbox(make_config({"main": database.url}, BROKERS, database.base_dir))
    async with outbox.transaction() as tx:
        await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(5)))
    await outbox.close()
    await database.execute(
        "UPDATE router_outbox SET status = 'published', published_at = '2026-01-01 00:00:00'"
    )

    assert run(database, "replay", "--target", "partner", "--dry-run").stdout == (
        "main: would replay 5 row(s) to partner\n"
    )
    lines = [
        json.loads(line)
        for line in run(database, "replay", "--target", "partner").stdout.splitlines()
    ]
    assert lines[-1] | {"elapsed": 0} == {
        "event": "done",
        "database": "main",
        "target": "partner",
        "total": 5,
        "done": 5,
        "skipped": 0,
        "elapsed": 0,
        "audit_id": lines[-1]["audit_id"],
    }
    assert all(line["event"] == "progress" for line in lines[:-1]) and lines[-2]["done"] == 5
    rows = await database.execute("SELECT target, status FROM router_outbox ORDER BY seq")
    assert sorted({(r["target"], r["status"]) for r in rows}) == [
        ("events", "published"),
        ("partner", "pending"),
    ]
    trail = json.loads(run(database, "audit", "--json").stdout)
    actions = [(e["action"], e["target"], e["row_count"]) for e in trail["actions"]]
    assert actions[:2] == [("replay-finished", "partner", 5), ("replay", "partner", 5)]

    resumed = run(database, "replay", "--resume", str(lines[-1]["audit_id"])).stdout.splitlines()
    assert json.loads(resumed[-1])["done"] == 0  # its rows were all put back already

    unknown = run(database, "replay", "--target", "nobody", code=2)
    assert unknown.stderr == (
        "router: unknown target 'nobody' in database 'main'; configured: ['events', 'partner']\n"
    )
    backfill = run(database, "replay", "--target", "partner", "--backfill", code=2)
    assert "list their modules under events:" in backfill.stderr
