"""The operations commands on a seeded outbox, on PostgreSQL, SQLite and MariaDB: status,
requeue, trace, pause, cleanup. Run as a user runs them: the `router` command against a config
file, with a router serving the same database where the command has to reach it."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.dialects import mysql, postgresql, sqlite

from router import ConfigError, Event, Outbox
from router.ops import outbox as operations
from router.ops import status as status_query
from router.ops.outbox import cleanup_batch, cleanup_by_key, cleanup_statement
from router.ops.schema import outbox as outbox_table
from tests.conftest import Database, NatsStreams, make_config, nats_broker
from tests.e2e.helpers import router
from tests.integration.events import OrderPlaced
from tests.integration.test_delivery import serving


class PaymentFailed(Event, type="payment_failed", published=True):
    order_id: str


BROKERS: dict[str, Any] = {
    "events": {"type": "memory", "internal": True},
    "partner": {"type": "memory"},
}


def write_config(database: Database, brokers: dict[str, Any] | None = None) -> None:
    """config.yaml in the database's folder (where a SQLite URL is relative to)."""
    (database.base_dir / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "service": "shop",
                "databases": {"main": database.url},
                "brokers": brokers or BROKERS,
                "http": {"enabled": False},
            }
        )
    )


def run(folder: Path, *args: str) -> Any:
    result = router(*args, cwd=folder)
    assert result.returncode in (0, 1), result.stderr
    return result


async def seed(database: Database) -> dict[str, list[str]]:
    """Rows in every state, with known times; returns message ids by label."""
    outbox = database.outbox(BROKERS)
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
    o = outbox_table
    await database.execute(
        sa.update(o).values(created_at=now - 20 * day),
        *(
            sa.update(o)
            .where(o.c.message_id == ids[label][0], o.c.target == "partner")
            .values(status=status, **values)
            for label, (status, values) in changes.items()
        ),
        # The internal target published everything long ago.
        sa.update(o)
        .where(o.c.target == "events")
        .values(status="published", published_at=now - 2 * day),
    )
    return ids


async def partner_rows(database: Database) -> dict[str, tuple[str, int]]:
    """(status, attempts) of the partner's rows, by message id."""
    o = outbox_table
    found = await database.execute(
        sa.select(o.c.message_id, o.c.status, o.c.attempts).where(o.c.target == "partner")
    )
    return {str(r["message_id"]): (r["status"], r["attempts"]) for r in found}


async def test_status_counts_every_state_per_target(database: Database) -> None:
    await seed(database)
    write_config(database)
    document = json.loads(run(database.base_dir, "status", "--json").stdout)
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

    human = run(database.base_dir, "status").stdout
    assert "database  target" in human
    assert "main      partner        1          1         1          3          3" in human
    assert "latest errors:" in human


async def test_requeue_filters_and_dry_run(database: Database) -> None:
    ids = await seed(database)
    write_config(database)
    folder = database.base_dir
    dry = json.loads(run(folder, "requeue", "--error", "refused", "--dry-run", "--json").stdout)
    assert dry == {"dry_run": True, "rows": {"main": 2}, "total": 2}
    assert (
        json.loads(
            run(folder, "requeue", "--event-type", "payment_failed", "--dry-run", "--json").stdout
        )["total"]
        == 1
    )
    assert (
        json.loads(run(folder, "requeue", "--since", "1d", "--dry-run", "--json").stdout)["total"]
        == 0
    )  # everything was created 20 days ago
    assert (
        json.loads(
            run(folder, "requeue", "--failed", "--target", "partner", "--dry-run", "--json").stdout
        )["total"]
        == 4
    )

    done = run(folder, "requeue", "--error", "refused", "--target", "partner")
    assert done.stdout.strip() == "main: requeued 2 row(s)"
    by_id = await partner_rows(database)
    assert by_id[ids["abandoned_old"][0]] == ("pending", 0)
    assert by_id[ids["abandoned_new"][0]] == ("pending", 0)
    assert by_id[ids["abandoned_large"][0]] == ("abandoned", 1)


async def test_trace_shows_every_targets_row(database: Database) -> None:
    ids = await seed(database)
    write_config(database)
    [message_id] = ids["abandoned_new"]
    document = json.loads(run(database.base_dir, "trace", message_id, "--json").stdout)
    rows = {r["target"]: r for r in document["rows"]}
    assert rows["events"]["status"] == "published"
    assert rows["events"]["published_at"] is not None
    assert rows["partner"]["status"] == "abandoned"
    assert rows["partner"]["attempts"] == 10
    assert rows["partner"]["last_error"] == "connection REFUSED again"
    [in_flight] = ids["in_flight"]
    human = run(database.base_dir, "trace", in_flight).stdout
    assert "processing" in human and "host:w0:1:abc" in human
    missing = run(database.base_dir, "trace", "01a20000-0000-7000-8000-000000000000")
    assert missing.returncode == 1
    assert "no outbox row has message id" in missing.stdout


async def test_cleanup_deletes_exactly_the_rows_past_retention(database: Database) -> None:
    ids = await seed(database)
    write_config(database)
    out = run(database.base_dir, "cleanup", "--json")
    # Defaults: published rows kept 7 days, abandoned rows 30 days.
    assert json.loads(out.stdout) == {
        "databases": [{"database": "main", "published": 2, "abandoned": 1, "inbox": 0, "gaps": 0}]
    }
    left = set(await partner_rows(database))
    [events_left] = await database.fetch(
        "SELECT count(*) AS n FROM router_outbox WHERE target = 'events'"
    )
    gone = {ids["published_old"][0], ids["published_old2"][0], ids["abandoned_old"][0]}
    assert not left & gone
    assert len(left) == 6
    assert events_left["n"] == 9  # published two days ago: kept


async def test_cleanup_in_batches_deletes_every_row_past_retention(database: Database) -> None:
    await seed_history(database, abandoned=100, old=900, recent=1000)
    config = make_config({"main": database.url}, BROKERS, base_dir=database.base_dir)
    done = await operations.cleanup(config, batch_size=150)
    # Two rows per event: the internal target's and the partner's.
    assert [(d.published, d.abandoned) for d in done] == [(2 * 900, 2 * 100)]
    [left] = await database.fetch("SELECT count(*) AS n FROM router_outbox")
    assert left["n"] == 2 * 1000
    if database.kind == "postgresql":
        # The history the rows were deleted from is vacuumed at once (the router's own
        # VACUUM reads the queue alone), autovacuum on or off.
        [history] = await database.fetch(
            "SELECT relname, vacuum_count FROM pg_stat_user_tables"
            " WHERE relname LIKE 'router_outbox%' AND vacuum_count > 0"
        )
        assert (history["relname"], history["vacuum_count"]) == ("router_outbox_done", 1)


async def seed_history(database: Database, *, abandoned: int, old: int, recent: int) -> None:
    """Events to both targets: ``abandoned`` abandoned 40 days ago, then ``old`` published 10
    days ago, then ``recent`` published an hour ago."""
    o, now = outbox_table, datetime.now(UTC)
    outbox = database.outbox(BROKERS)
    last = 0
    for count, values in (
        (abandoned, {"status": "abandoned", "last_attempt_at": now - timedelta(days=40)}),
        (old, {"status": "published", "published_at": now - timedelta(days=10)}),
        (recent, {"status": "published", "published_at": now - timedelta(hours=1)}),
    ):
        async with outbox.transaction() as tx:
            await tx.stage(*(PaymentFailed(order_id=f"o-{i}") for i in range(count)))
        await database.execute(sa.update(o).where(o.c.seq > last).values(**values))
        [newest] = await database.execute(sa.select(sa.func.max(o.c.seq).label("seq")))
        last = newest["seq"]
    await outbox.close()


# How a plan reads a whole table.
FULL_SCAN = {"postgresql": "Seq Scan on router_outbox", "sqlite": "SCAN router_outbox"}
DIALECTS: dict[str, Any] = {
    "postgresql": postgresql.dialect(),  # type: ignore[no-untyped-call]
    "sqlite": sqlite.dialect(),
    "mysql": mysql.dialect(),
}


async def plan(database: Database, statement: Any) -> str:
    """The database's plan for ``statement``, one line per step."""
    compiled = statement.compile(
        dialect=DIALECTS[database.kind], compile_kwargs={"literal_binds": True}
    )
    if database.kind == "sqlite":
        return "\n".join(
            r["detail"] for r in await database.fetch(f"EXPLAIN QUERY PLAN {compiled}")
        )
    found = await database.fetch(f"EXPLAIN {compiled}")
    if database.kind == "mysql":
        return "\n".join(f"{r['table']} {r['type']} {r['key']}" for r in found)
    return "\n".join(r["QUERY PLAN"] for r in found)


async def test_cleanup_batches_are_served_by_the_retention_indexes(database: Database) -> None:
    await seed_history(database, abandoned=500, old=4500, recent=5000)
    await database.execute(
        {"postgresql": "ANALYZE router_outbox", "sqlite": "ANALYZE"}.get(
            database.kind, "ANALYZE TABLE router_outbox"
        )
    )
    cutoff = datetime.now(UTC) - timedelta(days=7)
    if database.kind == "mysql":
        # As asyncmy sends it: rendered with its +00:00, MariaDB would compare the time as a
        # string and plan by status alone.
        cutoff = cutoff.replace(tzinfo=None)
    for status, column, index in (
        ("published", outbox_table.c.published_at, "ix_router_outbox_published"),
        ("abandoned", outbox_table.c.last_attempt_at, "ix_router_outbox_abandoned"),
    ):
        if database.kind == "mysql":
            # The keys first, off the retention index; then the rows by primary key.
            picked = await plan(database, cleanup_batch(status, column, cutoff, 5000))
            assert picked == f"router_outbox range {index}", picked
            deleting = await plan(database, cleanup_by_key(status, column, cutoff, [1, 2, 3]))
            assert deleting == "router_outbox range PRIMARY", deleting
            continue
        deleting = await plan(database, cleanup_statement(status, column, cutoff, 5000))
        assert index in deleting, deleting
        # The batch is found through the index, not by reading the table (on PostgreSQL the
        # DELETE may still hash-join with the table, which is cheaper at this size).
        first_step = deleting.split("->")[1] if database.kind == "postgresql" else deleting
        assert FULL_SCAN[database.kind] not in first_step, deleting


# How long a command may take to reach a running router. PostgreSQL's NOTIFY and SQLite's file
# watcher are there at once; MySQL's watcher looks at most every 15 seconds while idle.
WAKE_TIMEOUT = 20.0


def nats_brokers(nats_streams: NatsStreams) -> tuple[dict[str, Any], str, str]:
    """An internal and a partner broker on NATS; returns them and their stream names."""
    internal, partner = nats_streams.stream("int"), nats_streams.stream("ext")
    brokers = {"events": nats_broker(internal, internal=True), "partner": nats_broker(partner)}
    return brokers, internal[0], partner[0]


async def test_pause_is_honoured_by_a_running_router(
    database: Database, nats_streams: NatsStreams
) -> None:
    brokers, internal, partner = nats_brokers(nats_streams)
    config = make_config({"main": database.url}, brokers, base_dir=database.base_dir)
    write_config(database, brokers)
    folder = database.base_dir
    outbox = Outbox(config)
    async with serving(config):
        paused = run(folder, "pause", "partner")
        assert paused.stdout.strip() == "partner: paused in main"
        async with outbox.transaction() as tx:
            await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(5)))
        assert len(await nats_streams.messages(internal, 5)) == 5
        await asyncio.sleep(0.5)
        assert await nats_streams.messages(partner, 1, timeout=0.2) == []
        status = json.loads(run(folder, "status", "--json").stdout)
        assert {r["target"]: (r["paused"], r["pending"]) for r in status["targets"]} == {
            "events": (False, 0),
            "partner": (True, 5),
        }

        resumed = run(folder, "resume", "partner")
        assert resumed.stdout.strip() == "partner: resumed in main"
        assert len(await nats_streams.messages(partner, 5, timeout=WAKE_TIMEOUT)) == 5
    await outbox.close()


async def test_a_requeue_wakes_a_running_router(
    database: Database, nats_streams: NatsStreams
) -> None:
    brokers, internal, partner = nats_brokers(nats_streams)
    # No fallback poll within the test: only a wake-up brings the requeued rows out.
    outbox_settings = {"poll_interval": 3600}
    config = make_config(
        {"main": database.url}, brokers, base_dir=database.base_dir, outbox=outbox_settings
    )
    write_config(database, brokers)
    outbox = Outbox(config)
    async with outbox.transaction() as tx:
        await tx.stage(*(OrderPlaced(order_id=f"o-{i}", total=Decimal(i)) for i in range(3)))
    await outbox.close()
    o = outbox_table
    await database.execute(
        sa.update(o)
        .where(o.c.target == "partner")
        .values(status="abandoned", attempts=10, last_error="connection refused")
    )
    async with serving(config):
        assert len(await nats_streams.messages(internal, 3)) == 3
        await asyncio.sleep(1.0)  # every processor idle, the watcher backing off
        assert await nats_streams.messages(partner, 1, timeout=0.2) == []
        done = run(database.base_dir, "requeue", "--target", "partner")
        assert done.stdout.strip() == "main: requeued 3 row(s)"
        assert len(await nats_streams.messages(partner, 3, timeout=WAKE_TIMEOUT)) == 3


async def test_a_missing_mysql_driver_names_the_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("router._db.MYSQL_DRIVER", "no_such_mysql_driver")
    config = make_config({"orders": "mysql://root@127.0.0.1/x"}, BROKERS)
    expected = (
        "databases.orders: a MySQL or MariaDB database needs the no_such_mysql_driver driver "
        "(no_such_mysql_driver is not installed): pip install 'outbox-router[mysql]'"
    )
    for command in (
        status_query.status(config),
        operations.requeue(config),
        operations.set_paused(config, "partner", paused=True),
        operations.cleanup(config),
    ):
        with pytest.raises(ConfigError) as caught:
            await command
        assert str(caught.value) == expected
    with pytest.raises(ConfigError) as caught:
        Outbox(config).engine()
    assert str(caught.value) == expected
