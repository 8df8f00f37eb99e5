"""Held and parked stream keys, run as a user runs them, on PostgreSQL, SQLite and MariaDB: a
relay serves a target whose stream ``k`` is parked and whose stream ``other`` is held; then
`router held`, `router release` (a key, then a failure group with --drop) and `router audit`,
and what each did to the outbox, the gaps and the audit trail, the relay delivering what was
released without being told more."""

from __future__ import annotations

import asyncio
import getpass
import json
import re
import socket
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml

from router import Outbox
from router.ops.schema import outbox as outbox_table
from tests.conftest import Database, make_config
from tests.e2e.helpers import router
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving

ACTOR = f"{getpass.getuser()}@{socket.gethostname()}"
TOO_LARGE = "not retryable: rejected by JetStream: maximum payload exceeded (err_code 10054)"
GONE = "gave up after 3 attempts: rejected by JetStream: no responders (err_code 503)"
BROKERS = {"events": {"type": "memory", "internal": True, "ordering": "park"}}


def run(folder: Path, *args: str, code: int = 0) -> Any:
    result = router(*args, cwd=folder)
    assert result.returncode == code, result
    return result


def document(folder: Path, *args: str) -> Any:
    return json.loads(run(folder, *args, "--json").stdout)


def columns(line: str) -> list[str]:
    """The cells of a line of a table the router printed."""
    return re.split(r"\s{2,}", line.strip())


async def statuses(database: Database) -> dict[str, str]:
    """Each row's status, by its order id."""
    rows = await database.rows()
    return {r["envelope"]["payload"]["order_id"]: r["status"] for r in rows}


async def set_aside(database: Database) -> dict[str, str]:
    """Orders 1, 2, 3 on stream k and 11, 12 on stream other. The broker refused 2 for good a
    minute ago, and the target parked it with 3; 12 ran out of attempts and is held. Returns
    the message ids by order id."""
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "service": "shop",
                "databases": {"main": database.url},
                "brokers": BROKERS,
                "http": {"enabled": False},
            }
        )
    )
    outbox = Outbox(make_config({"main": database.url}, BROKERS, base_dir=database.base_dir))
    try:
        async with outbox.transaction() as tx:
            await tx.stage(
                *(OrderPlaced(order_id=str(n), total=Decimal(n)) for n in (1, 2, 3, 11, 12)),
                stream_keys=["k", "k", "k", "other", "other"],
            )
    finally:
        await outbox.close()
    ids = {r["envelope"]["payload"]["order_id"]: r["message_id"] for r in await database.rows()}
    o = outbox_table
    then = datetime.now(UTC) - timedelta(minutes=1)
    tried = {"attempts": 1, "last_attempt_at": then, "first_attempt_at": then}
    await database.execute(
        sa.update(o)
        .where(o.c.message_id == ids["2"])
        .values(status="parked", last_error=TOO_LARGE, **tried),
        sa.update(o).where(o.c.message_id == ids["3"]).values(status="parked"),
        sa.update(o)
        .where(o.c.message_id == ids["12"])
        .values(status="held", last_error=GONE, **{**tried, "attempts": 3}),
    )
    return ids


async def until(database: Database, expected: dict[str, str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (found := await statuses(database)) != expected:
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.05)


async def test_held_keys_are_listed_released_and_audited(database: Database) -> None:
    ids = await set_aside(database)
    folder = database.base_dir
    config = make_config({"main": database.url}, BROKERS, base_dir=database.base_dir)

    async with serving(config):  # the relay delivers what is free, and waits on the rest
        await until(
            database,
            {"1": "published", "2": "parked", "3": "parked", "11": "published", "12": "held"},
        )

        keys = document(folder, "held")["keys"]
        # Oldest head first; both were given up on a minute ago, so by key.
        assert [(k["stream_key"], k["status"], k["behind"]) for k in keys] == [
            ("k", "parked", 1),
            ("other", "held", 0),
        ]
        by_key = {k["stream_key"]: k for k in keys}
        assert by_key["k"]["message_id"] == ids["2"]
        assert by_key["k"]["last_error"] == TOO_LARGE
        assert by_key["k"]["age_seconds"] >= 59
        human = [columns(line) for line in run(folder, "held", "events").stdout.splitlines()]
        assert human[0] == [
            "database",
            "target",
            "key",
            "status",
            "behind",
            "age",
            "head",
            "group",
            "error",
        ]
        assert [line[:5] for line in human[2:]] == [
            ["main", "events", "k", "parked", "1"],
            ["main", "events", "other", "held", "0"],
        ]
        run(folder, "held", "partner", code=2)  # no such target

        done = run(folder, "release", "events", "k", "--reason", "partner raised its limit")
        assert done.stdout == f"main/events k: retrying {ids['2']}, 2 row(s) back to pending\n"
        await until(
            database,
            {"1": "published", "2": "published", "3": "published", "11": "published", "12": "held"},
        )
        again = run(folder, "release", "events", "k", "--reason", "twice", code=1)
        assert "'k' is not held or parked on events" in again.stderr

        group = by_key["other"]["group"]
        assert group in [g["id"] for g in document(folder, "groups")["groups"]]
        dropped = document(
            folder, "release", "--group", group, "--drop", "--reason", "the order was voided"
        )["released"]
        assert [(r["stream_key"], r["message_id"], r["dropped"]) for r in dropped] == [
            ("other", ids["12"], True)
        ]
        assert await statuses(database) == {
            "1": "published",
            "2": "published",
            "3": "published",
            "11": "published",
            "12": "abandoned",
        }
        gaps = await database.fetch("SELECT stream_key, message_id FROM router_gaps")
        assert [(g["stream_key"], str(g["message_id"])) for g in gaps] == [("other", ids["12"])]

    assert run(folder, "held").stdout == "no held or parked stream keys\n"
    run(folder, "release", "events", code=2)  # a key, or --group
    run(folder, "release", "--group", group, "events", "k", "--reason", "x", code=2)
    assert "--reason" in run(folder, "release", "events", "k", code=2).stderr

    trail = document(folder, "audit")["actions"]
    assert [(a["actor"], a["action"], a["target"], a["row_count"]) for a in trail] == [
        (ACTOR, "release", "events", 0),
        (ACTOR, "release", "events", 2),
    ]
    assert trail[0]["detail"]["reason"] == "the order was voided"
    assert trail[0]["detail"]["group"] == group
    assert trail[0]["detail"]["drop"] is True
    assert trail[1]["detail"] == {
        "database": "main",
        "stream_key": "k",
        "message_id": ids["2"],
        "drop": False,
        "reason": "partner raised its limit",
    }
