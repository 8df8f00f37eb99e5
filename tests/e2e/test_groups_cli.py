"""Failure groups, run as a user runs them, on PostgreSQL, SQLite and MariaDB: a router fails
rows against a partner that is down, others were rejected earlier; then `router groups`,
`router requeue --group`, `router discard --group` and `router audit`, and what each did to
the outbox and its audit trail."""

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
from tests.services import free_port

ACTOR = f"{getpass.getuser()}@{socket.gethostname()}"
REJECTED = "rejected by JetStream: maximum payload exceeded (code 400, err_code 10054)"
# The partner is down for good: each row fails once, then waits an hour for its next try.
FAILED = ("failed", "abandoned")
RETRY = {"max_attempts": 3, "base_delay": 3600, "max_delay": 3600}


def brokers() -> dict[str, Any]:
    """An internal broker that takes everything, and a NATS partner where nothing listens."""
    dead = f"nats://127.0.0.1:{free_port()}"
    partner = {
        "type": "nats",
        "url": dead,
        "destination": "shop.{event_type}",
        "stream": {"name": "SHOP", "subjects": ["shop.>"]},
    }
    return {"events": {"type": "memory", "internal": True}, "partner": partner}


def run(folder: Path, *args: str, code: int = 0) -> Any:
    result = router(*args, cwd=folder)
    assert result.returncode == code, result
    return result


def columns(line: str) -> list[str]:
    """The cells of a line of a table the router printed."""
    return re.split(r"\s{2,}", line.strip())


def document(folder: Path, *args: str) -> Any:
    return json.loads(run(folder, *args, "--json").stdout)


async def partner_rows(database: Database) -> dict[str, tuple[str, int]]:
    """(status, attempts) of the partner's rows, by message id."""
    o = outbox_table
    found = await database.execute(
        sa.select(o.c.message_id, o.c.status, o.c.attempts).where(o.c.target == "partner")
    )
    return {str(r["message_id"]): (r["status"], r["attempts"]) for r in found}


async def fail_some(database: Database) -> tuple[list[str], list[str]]:
    """Six events. The partner rejected two of them a day ago (abandoned, not retryable);
    a router then tries the other four against the partner that is down: three wait to be
    retried, one (tried twice before) is given up. Returns (refused ids, rejected ids)."""
    brokers_ = brokers()
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "service": "shop",
                "databases": {"main": database.url},
                "brokers": brokers_,
                "http": {"enabled": False},
            }
        )
    )
    config = make_config(
        {"main": database.url}, brokers_, base_dir=database.base_dir, outbox={"retry": RETRY}
    )
    outbox = Outbox(config)
    ids: list[str] = []
    async with outbox.transaction() as tx:
        for i in range(6):
            [message_id] = await tx.stage(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)))
            ids.append(message_id)
    await outbox.close()
    refused, rejected = ids[:4], ids[4:]
    o = outbox_table
    partner = o.c.target == "partner"
    await database.execute(
        sa.update(o)
        .where(partner, o.c.message_id.in_(rejected))
        .values(
            status="abandoned",
            attempts=1,
            last_error=f"not retryable: {REJECTED}",
            last_attempt_at=datetime.now(UTC) - timedelta(days=1),
        ),
    )
    # An unreachable partner costs rows no attempt (they wait behind its open circuit): the
    # four refused rows are given what a broker's retryable refusal leaves, as a router
    # before 0.2 left them for an unreachable one. One, tried twice before, gave up.
    now = datetime.now(UTC)
    error = "partner: cannot connect to NATS: ConnectionRefusedError: [Errno 111] refused"
    tried = {"first_attempt_at": now, "last_attempt_at": now}
    await database.execute(
        sa.update(o)
        .where(partner, o.c.message_id.in_(refused[1:]))
        .values(
            status="failed",
            attempts=1,
            last_error=error,
            available_at=now + timedelta(hours=1),
            **tried,
        ),
        sa.update(o)
        .where(partner, o.c.message_id == refused[0])
        .values(
            status="abandoned",
            attempts=3,
            last_error=f"gave up after 3 attempts: {error}",
            **tried,
        ),
    )
    async with serving(config):  # the internal broker takes every event meanwhile
        deadline = time.monotonic() + 20
        while await pending(database):
            assert time.monotonic() < deadline, await partner_rows(database)
            await asyncio.sleep(0.05)
    return refused, rejected


async def pending(database: Database) -> int:
    """Rows of the internal broker not published yet."""
    o = outbox_table
    found = await database.execute(
        sa.select(o.c.message_id).where(o.c.target == "events", o.c.status != "published")
    )
    return len(list(found))


async def audit_trail(database: Database) -> list[dict[str, Any]]:
    actions: list[dict[str, Any]] = document(database.base_dir, "audit")["actions"]
    return actions


async def test_groups_requeue_and_discard_one_group_at_a_time(database: Database) -> None:
    refused, rejected = await fail_some(database)
    folder = database.base_dir
    before = await partner_rows(database)
    assert sorted(status for status, _ in before.values()) == ["abandoned"] * 3 + ["failed"] * 3

    groups = document(folder, "groups")["groups"]
    assert [(g["target"], g["count"], g["statuses"]) for g in groups] == [
        ("partner", 4, {"failed": 3, "abandoned": 1}),  # tried just now: the newest first
        ("partner", 2, {"failed": 0, "abandoned": 2}),
    ]
    down, bounced = groups
    assert down["error_class"] == "ConnectionRefusedError" and down["code"] is None
    assert down["message"].startswith("partner: cannot connect to NATS: ConnectionRefusedError")
    assert down["sample"]["message_id"] == refused[0]
    assert "gave up after 3 attempts: partner: cannot connect" in down["sample"]["last_error"]
    assert (bounced["error_class"], bounced["code"]) == ("rejected", "err_code 10054")
    assert bounced["message"] == (
        "rejected by JetStream: maximum payload exceeded (code <n>, err_code <n>)"
    )
    assert bounced["first_seen"] == bounced["last_seen"] < down["first_seen"] <= down["last_seen"]
    human = [columns(line) for line in run(folder, "groups").stdout.splitlines()]
    assert human[0] == [
        "id",
        "database",
        "target",
        "class",
        "code",
        "count",
        "failed",
        "abandoned",
        "first seen",
        "last seen",
        "message",
    ]
    assert human[2][:8] == [down["id"], "main", "partner", down["error_class"], "-", "4", "3", "1"]
    assert human[2][-1] == down["message"]

    dry = run(folder, "requeue", "--group", down["id"], "--dry-run")
    assert dry.stdout == "main: would requeue 4 row(s)\n"
    assert await partner_rows(database) == before
    assert await audit_trail(database) == []

    done = run(folder, "requeue", "--group", down["id"])
    assert done.stdout == "main: requeued 4 row(s)\n"
    after = await partner_rows(database)
    assert {after[i] for i in refused} == {("pending", 0)}
    assert {after[i] for i in rejected} == {("abandoned", 1)}
    [requeued] = await audit_trail(database)
    assert (requeued["actor"], requeued["action"], requeued["target"]) == (
        ACTOR,
        "requeue",
        "partner",
    )
    assert requeued["row_count"] == 4 and requeued["database"] == "main"
    assert requeued["detail"]["group"] == down["id"]
    assert requeued["detail"]["statuses"] == ["failed", "abandoned"]
    assert [g["id"] for g in document(folder, "groups")["groups"]] == [bounced["id"]]

    dry = run(folder, "discard", "--group", bounced["id"], "--dry-run")
    assert dry.stdout == "main: would discard 2 row(s)\n"
    assert len(await partner_rows(database)) == 6

    done = run(folder, "discard", "--group", bounced["id"])
    assert done.stdout == "main: discarded 2 row(s)\n"
    assert sorted(await partner_rows(database)) == sorted(refused)
    events = await database.execute(
        sa.select(outbox_table).where(outbox_table.c.target == "events")
    )
    assert sorted(str(r["message_id"]) for r in events) == sorted(refused + rejected)
    discarded, _ = await audit_trail(database)
    assert (discarded["actor"], discarded["action"], discarded["row_count"]) == (
        ACTOR,
        "discard",
        2,
    )
    detail = discarded["detail"]
    assert (detail["group"], detail["target"], detail["error_class"], detail["code"]) == (
        bounced["id"],
        "partner",
        "rejected",
        "err_code 10054",
    )
    assert detail["message"] == bounced["message"]
    assert sorted(detail["message_ids"]) == sorted(rejected)

    assert run(folder, "groups").stdout == "no failed or abandoned rows\n"
    trail = [columns(line) for line in run(folder, "audit").stdout.splitlines()]
    assert trail[0] == ["at", "database", "actor", "action", "target", "rows", "detail"]
    assert [line[2:6] for line in trail[2:]] == [
        [ACTOR, "discard", "partner", "2"],
        [ACTOR, "requeue", "partner", "4"],
    ]
    assert trail[2][6].startswith("code=err_code 10054 database=main error_class=rejected group=")


async def test_an_unknown_group_exits_1(database: Database) -> None:
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {"service": "shop", "databases": {"main": database.url}, "brokers": brokers()}
        )
    )
    for command in ("requeue", "discard"):
        result = run(database.base_dir, command, "--group", "0123456789", code=1)
        assert result.stderr == "router: no failure group 0123456789 (router groups lists them)\n"
    assert await audit_trail(database) == []


async def test_pause_resume_and_a_filtered_requeue_are_audited(database: Database) -> None:
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {"service": "shop", "databases": {"main": database.url}, "brokers": brokers()}
        )
    )
    folder = database.base_dir
    run(folder, "pause", "partner")
    run(folder, "resume", "partner")
    run(folder, "requeue", "--target", "partner", "--error", "refused", "--dry-run")
    run(folder, "requeue", "--target", "partner", "--error", "refused")
    trail = await audit_trail(database)
    assert [(a["actor"], a["action"], a["target"], a["row_count"]) for a in trail] == [
        (ACTOR, "requeue", None, 0),
        (ACTOR, "resume", "partner", 1),
        (ACTOR, "pause", "partner", 1),
    ]
    assert trail[0]["detail"]["targets"] == ["partner"]
    assert trail[0]["detail"]["error"] == "refused"
    [_, _, latest] = run(folder, "audit", "--limit", "1").stdout.splitlines()
    assert columns(latest)[3] == "requeue"


async def test_requeue_by_group_takes_no_other_filter(database: Database) -> None:
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {"service": "shop", "databases": {"main": database.url}, "brokers": brokers()}
        )
    )
    result = run(database.base_dir, "requeue", "--group", "g", "--failed", "--target", "x", code=2)
    assert result.stderr == "router: --group picks its rows itself; drop --target, --failed\n"
