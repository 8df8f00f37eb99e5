"""The operations commands on a seeded PostgreSQL outbox: status, requeue, trace, pause,
cleanup. Run as a user runs them: the `router` command against a config file."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml
from sqlalchemy.dialects import postgresql

from router import Event, Outbox
from router.ops._schema import outbox as outbox_table
from router.ops.operations import cleanup_statement
from tests.conftest import NatsStreams, make_config, nats_broker
from tests.e2e.helpers import router
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving


class PaymentFailed(Event, type="payment_failed", published=True):
    order_id: str


BROKERS: dict[str, Any] = {
    "events": {"type": "memory", "internal": True},
    "partner": {"type": "memory"},
}


def write_config(folder: Path, url: str, brokers: dict[str, Any] | None = None) -> None:
    (folder / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "service": "shop",
                "databases": {"main": url},
                "brokers": brokers or BROKERS,
                "http": {"enabled": False},
            }
        )
    )


def run(folder: Path, *args: str) -> Any:
    result = router(*args, cwd=folder)
    assert result.returncode in (0, 1), result.stderr
    return result


async def seed(url: str) -> dict[str, list[str]]:
    """Rows in every state, with known times; returns message ids by label."""
    outbox = Outbox(make_config({"main": url}, BROKERS))
    ids: dict[str, list[str]] = {}
    async with outbox.transaction() as tx:
        for label in (
            "published_old",
            "published_old2",
            "published_new",
            "abandoned_old",
            "abandoned_new",
            "failed",
            "pending",
            "in_flight",
        ):
            ids[label] = await tx.stage(OrderPlaced(order_id=label, total=Decimal(1)))
        ids["abandoned_large"] = await tx.stage(PaymentFailed(order_id="big"))
    await outbox.close()
    now = datetime.now(UTC)
    day = timedelta(days=1)
    changes: dict[str, tuple[str, dict[str, Any]]] = {
        "published_old": ("published", {"published_at": now - 10 * day}),
        "published_old2": ("published", {"published_at": now - 8 * day}),
        "published_new": ("published", {"published_at": now - day}),
        "abandoned_old": (
            "abandoned",
            {
                "last_attempt_at": now - 40 * day,
                "last_error": "Connection refused by partner",
                "attempts": 10,
            },
        ),
        "abandoned_new": (
            "abandoned",
            {
                "last_attempt_at": now - timedelta(minutes=1),
                "last_error": "connection REFUSED again",
                "attempts": 10,
            },
        ),
        "abandoned_large": (
            "abandoned",
            {
                "last_attempt_at": now - timedelta(minutes=2),
                "last_error": "message too large",
                "attempts": 1,
            },
        ),
        "failed": (
            "failed",
            {
                "available_at": now + timedelta(hours=1),
                "attempts": 2,
                "last_attempt_at": now - timedelta(minutes=3),
                "last_error": "timeout",
            },
        ),
        "in_flight": (
            "processing",
            {
                "locked_by": "host:w0:1:abc",
                "locked_until": now + timedelta(minutes=5),
                "attempts": 1,
            },
        ),
    }
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("UPDATE router_outbox SET created_at = $1", now - 20 * day)
        for label, (status, values) in changes.items():
            sets = ", ".join(f"{k} = ${i + 3}" for i, k in enumerate(values))
            await conn.execute(
                f"UPDATE router_outbox SET status = $2, {sets} "
                "WHERE message_id = $1::uuid AND target = 'partner'",
                ids[label][0],
                status,
                *values.values(),
            )
        # The internal target published everything long ago.
        await conn.execute(
            "UPDATE router_outbox SET status = 'published', published_at = $1 "
            "WHERE target = 'events'",
            now - 2 * day,
        )
    finally:
        await conn.close()
    return ids


async def test_status_counts_every_state_per_target(pg_url: str, tmp_path: Path) -> None:
    await seed(pg_url)
    write_config(tmp_path, pg_url)
    document = json.loads(run(tmp_path, "status", "--json").stdout)
    rows = {r["target"]: r for r in document["targets"]}
    partner = rows["partner"]
    assert (
        partner["pending"],
        partner["in_flight"],
        partner["failed"],
        partner["abandoned"],
        partner["published"],
    ) == (1, 1, 1, 3, 3)
    assert partner["oldest_claimable_age"] == pytest.approx(20 * 86400, rel=0.01)
    assert partner["retries_per_minute"] == pytest.approx(3 / 5)  # failed + 2 abandoned, 5 min
    assert partner["circuit"] == "closed" and partner["paused"] is False
    assert partner["last_error"] == "connection REFUSED again"
    assert rows["events"]["published"] == 9 and rows["events"]["pending"] == 0

    human = run(tmp_path, "status").stdout
    assert "database  target" in human
    assert "main      partner        1          1         1          3          3" in human
    assert "latest errors:" in human


async def test_requeue_filters_and_dry_run(pg_url: str, tmp_path: Path) -> None:
    ids = await seed(pg_url)
    write_config(tmp_path, pg_url)
    dry = json.loads(run(tmp_path, "requeue", "--error", "refused", "--dry-run", "--json").stdout)
    assert dry == {"dry_run": True, "rows": {"main": 2}, "total": 2}
    assert (
        json.loads(
            run(tmp_path, "requeue", "--event-type", "payment_failed", "--dry-run", "--json").stdout
        )["total"]
        == 1
    )
    assert (
        json.loads(run(tmp_path, "requeue", "--since", "1d", "--dry-run", "--json").stdout)["total"]
        == 0
    )  # everything was created 20 days ago
    assert (
        json.loads(
            run(
                tmp_path, "requeue", "--failed", "--target", "partner", "--dry-run", "--json"
            ).stdout
        )["total"]
        == 4
    )

    done = run(tmp_path, "requeue", "--error", "refused", "--target", "partner")
    assert done.stdout.strip() == "main: requeued 2 row(s)"
    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch(
            "SELECT message_id::text, status, attempts, locked_by FROM router_outbox "
            "WHERE target = 'partner' AND message_id = ANY($1::uuid[])",
            [ids["abandoned_old"][0], ids["abandoned_new"][0], ids["abandoned_large"][0]],
        )
    finally:
        await conn.close()
    by_id = {r[0]: (r[1], r[2]) for r in rows}
    assert by_id[ids["abandoned_old"][0]] == ("pending", 0)
    assert by_id[ids["abandoned_new"][0]] == ("pending", 0)
    assert by_id[ids["abandoned_large"][0]] == ("abandoned", 1)


async def test_trace_shows_every_targets_row(pg_url: str, tmp_path: Path) -> None:
    ids = await seed(pg_url)
    write_config(tmp_path, pg_url)
    [message_id] = ids["abandoned_new"]
    document = json.loads(run(tmp_path, "trace", message_id, "--json").stdout)
    rows = {r["target"]: r for r in document["rows"]}
    assert rows["events"]["status"] == "published"
    assert rows["events"]["published_at"] is not None
    assert rows["partner"]["status"] == "abandoned"
    assert rows["partner"]["attempts"] == 10
    assert rows["partner"]["last_error"] == "connection REFUSED again"
    [in_flight] = ids["in_flight"]
    human = run(tmp_path, "trace", in_flight).stdout
    assert "processing" in human and "host:w0:1:abc" in human
    missing = run(tmp_path, "trace", "01a20000-0000-7000-8000-000000000000")
    assert missing.returncode == 1
    assert "no outbox row has message id" in missing.stdout


async def test_cleanup_deletes_exactly_the_rows_past_retention(pg_url: str, tmp_path: Path) -> None:
    ids = await seed(pg_url)
    write_config(tmp_path, pg_url)
    out = run(tmp_path, "cleanup", "--json")
    # Defaults: published rows kept 7 days, abandoned rows 30 days.
    assert json.loads(out.stdout) == {
        "databases": [{"database": "main", "published": 2, "abandoned": 1, "inbox": 0}]
    }
    conn = await asyncpg.connect(pg_url)
    try:
        left = {
            r[0]
            for r in await conn.fetch(
                "SELECT message_id::text FROM router_outbox WHERE target = 'partner'"
            )
        }
        events_left = await conn.fetchval(
            "SELECT count(*) FROM router_outbox WHERE target = 'events'"
        )
    finally:
        await conn.close()
    gone = {ids["published_old"][0], ids["published_old2"][0], ids["abandoned_old"][0]}
    assert not left & gone
    assert len(left) == 6
    assert events_left == 9  # published two days ago: kept


async def test_cleanup_batches_are_served_by_the_retention_indexes(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("""
            INSERT INTO router_outbox (message_id, target, destination, event_type, envelope,
                                       status, published_at, last_attempt_at)
            SELECT gen_random_uuid(), 'partner', 'd', 't', '{}'::json,
                   CASE WHEN i % 10 = 0 THEN 'abandoned' ELSE 'published' END,
                   now() - make_interval(days => i % 60), now() - make_interval(days => i % 60)
            FROM generate_series(1, 20000) AS i""")
        await conn.execute("ANALYZE router_outbox")
        dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
        cutoff = datetime.now(UTC) - timedelta(days=7)
        for status, column, index in (
            ("published", outbox_table.c.published_at, "ix_router_outbox_published"),
            ("abandoned", outbox_table.c.last_attempt_at, "ix_router_outbox_abandoned"),
        ):
            statement = cleanup_statement(status, column, cutoff, 5000).compile(
                dialect=dialect, compile_kwargs={"literal_binds": True}
            )
            plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN {statement}"))
            assert index in plan, plan
            assert "Seq Scan on router_outbox" not in plan.split("->")[1], plan
    finally:
        await conn.close()


async def test_pause_is_honoured_by_a_running_router(
    pg_url: str, nats_streams: NatsStreams, tmp_path: Path
) -> None:
    internal, partner = nats_streams.stream("int"), nats_streams.stream("ext")
    brokers = {"events": nats_broker(internal, internal=True), "partner": nats_broker(partner)}
    config = make_config({"main": pg_url}, brokers)
    write_config(tmp_path, pg_url, brokers)
    outbox = Outbox(config)
    async with serving(config):
        paused = run(tmp_path, "pause", "partner")
        assert paused.stdout.strip() == "partner: paused in main"
        async with outbox.transaction() as tx:
            await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(5)))
        assert len(await nats_streams.messages(internal[0], 5)) == 5
        await asyncio.sleep(0.5)
        assert await nats_streams.messages(partner[0], 1, timeout=0.2) == []
        status = json.loads(run(tmp_path, "status", "--json").stdout)
        assert {r["target"]: (r["paused"], r["pending"]) for r in status["targets"]} == {
            "events": (False, 0),
            "partner": (True, 5),
        }

        resumed = run(tmp_path, "resume", "partner")
        assert resumed.stdout.strip() == "partner: resumed in main"
        assert len(await nats_streams.messages(partner[0], 5)) == 5
    await outbox.close()
