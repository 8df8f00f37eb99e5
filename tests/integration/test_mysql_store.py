"""The MySQL/MariaDB store against a real MariaDB: init-db, claims (SKIP LOCKED, streams in
order, pause), fenced leases, retries, release, circuits, the watcher, an old server, and a
missing driver."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncmy
import pytest

from envelopes import DatabaseError, SchemaError
from router import ConfigError, Outbox, parse_config
from router.config import DatabaseSettings
from router.ops.migrate import current_revision, upgrade
from router.relay.store import SCHEMA_REVISION, Marks, open_store
from router.relay.store.mysql import MysqlStore, unsupported_server
from tests.conftest import MYSQL_ADMIN, MysqlDatabases, make_config, mysql_fetch
from tests.integration.events import OrderPlaced

BROKERS = {"events": {"type": "memory", "internal": True}, "partner": {"type": "memory"}}


def settings(url: str) -> DatabaseSettings:
    return DatabaseSettings.model_validate({"url": url})


@pytest.fixture
async def store(mysql_url: str) -> AsyncIterator[MysqlStore]:
    opened = open_store("main", settings(mysql_url), Path.cwd())
    assert isinstance(opened, MysqlStore)
    yield opened
    await opened.close()


async def stage(url: str, *keys: str | None) -> None:
    """One event per key (its order id is ``key-i``), in one transaction."""
    outbox = Outbox(make_config({"main": url}, BROKERS))
    async with outbox.transaction() as tx:
        await tx.stage(
            *[OrderPlaced(order_id=f"{key}-{i}", total=Decimal(i)) for i, key in enumerate(keys)],
            stream_keys=list(keys),
        )
    await outbox.close()


def order_ids(rows: list[Any]) -> list[str]:
    return [json.loads(row.envelope)["payload"]["order_id"] for row in rows]


async def rows_of(url: str, target: str = "events") -> list[dict[str, Any]]:
    return await mysql_fetch(
        url,
        "SELECT seq, status, attempts, locked_by, last_error FROM router_outbox "
        "WHERE target = %s ORDER BY seq",
        target,
    )


async def test_init_db_creates_the_tables_at_the_revision_the_store_serves(
    mysql_databases: MysqlDatabases,
) -> None:
    url = await mysql_databases.new(migrated=False)
    empty = open_store("main", settings(url), Path.cwd())
    try:
        with pytest.raises(SchemaError, match="has no router tables; run `router init-db`"):
            await empty.check_schema()
        result = await upgrade("main", settings(url), Path.cwd())
        assert (result.before, result.after) == (None, SCHEMA_REVISION)
        await empty.check_schema()
    finally:
        await empty.close()
    again = await upgrade("main", settings(url), Path.cwd())
    assert not again.changed
    assert await current_revision("main", settings(url), Path.cwd()) == SCHEMA_REVISION
    tables = await mysql_fetch(
        url,
        "SELECT TABLE_NAME AS name, ENGINE AS engine FROM information_schema.TABLES "
        "WHERE TABLE_SCHEMA = DATABASE() ORDER BY 1",
    )
    assert [(t["name"], t["engine"]) for t in tables] == [
        (name, "InnoDB")
        for name in (
            "router_alembic_version",
            "router_audit",
            "router_gaps",
            "router_inbox",
            "router_outbox",
            "router_streams",
            "router_targets",
        )
    ]


async def test_a_claim_leases_due_rows_in_outbox_order(mysql_url: str, store: MysqlStore) -> None:
    await stage(mysql_url, "a", None, "b")
    claim = await store.claim("events", 10, "w1", 30)
    assert order_ids(claim.rows) == ["a-0", "None-1", "b-2"]
    assert [(r.stream_key, r.attempts) for r in claim.rows] == [("a", 1), (None, 1), ("b", 1)]
    assert all(r.created_at is not None for r in claim.rows)
    stored = await rows_of(mysql_url)
    assert {(r["status"], r["locked_by"], r["attempts"]) for r in stored} == {
        ("processing", "w1", 1)
    }
    # Leased rows are not claimed again while the lease lasts; the partner's rows are its own.
    assert (await store.claim("events", 10, "w2", 30)).rows == []
    assert len((await store.claim("partner", 10, "w2", 30)).rows) == 3


async def test_two_workers_claiming_at_once_never_share_a_row(
    mysql_url: str, store: MysqlStore
) -> None:
    await stage(mysql_url, *[None] * 40)
    other = open_store("main", settings(mysql_url), Path.cwd())
    try:
        claims = await asyncio.gather(
            *(s.claim("events", 7, f"w{i}", 30) for i in range(3) for s in (store, other))
        )
    finally:
        await other.close()
    seqs = [row.seq for claim in claims for row in claim.rows]
    assert len(seqs) == len(set(seqs)) == 40


@pytest.fixture
async def held(mysql_url: str) -> AsyncIterator[Any]:
    """A connection of another transaction, to lock rows with ``FOR UPDATE``."""
    conn = await asyncmy.connect(**MYSQL_ADMIN, database=mysql_url.rpartition("/")[2])
    await conn.begin()
    yield conn
    await conn.rollback()
    await conn.ensure_closed()


async def test_a_row_another_transaction_holds_is_skipped_not_waited_for_and_holds_its_stream(
    mysql_url: str, store: MysqlStore, held: Any
) -> None:
    await stage(mysql_url, "a", "a", "b")
    first = (await rows_of(mysql_url))[0]["seq"]
    async with held.cursor() as cursor:
        await cursor.execute("SELECT seq FROM router_outbox WHERE seq = %s FOR UPDATE", [first])
    claim = await asyncio.wait_for(store.claim("events", 10, "w1", 30), 2)
    # a-0 is locked elsewhere (a mark in progress, say): a-1 must not overtake it.
    assert order_ids(claim.rows) == ["b-2"]


async def test_a_row_waits_while_an_earlier_row_of_its_stream_is_in_flight_or_failed(
    mysql_url: str, store: MysqlStore
) -> None:
    await stage(mysql_url, "a", "a", "b", "a")
    head = await store.claim("events", 1, "w1", 30)
    assert order_ids(head.rows) == ["a-0"]
    # a-0 is in flight: its stream waits, b flows.
    assert order_ids((await store.claim("events", 10, "w2", 30)).rows) == ["b-2"]
    await store.mark("events", head.token, Marks(failed=[(head.rows[0].seq, 0.4, "partner busy")]))
    # a-0 is waiting to retry: still only b's, and nothing else of a.
    assert (await store.claim("events", 10, "w2", 30)).rows == []
    await asyncio.sleep(0.45)
    retry = await store.claim("events", 10, "w3", 30)
    assert order_ids(retry.rows) == ["a-0", "a-1", "a-3"]
    assert [r.attempts for r in retry.rows] == [2, 1, 1]
    assert (await rows_of(mysql_url))[0]["last_error"] == "partner busy"


async def test_marks_apply_only_to_rows_still_held_under_the_claims_token(
    mysql_url: str, store: MysqlStore
) -> None:
    await stage(mysql_url, None, None, None, None)
    stale = await store.claim("events", 10, "paused-worker", 0.05)
    await asyncio.sleep(0.2)  # the lease runs out; another worker takes the rows over
    fresh = await store.claim("events", 10, "healthy-worker", 30)
    seqs = [r.seq for r in stale.rows]
    assert [r.seq for r in fresh.rows] == seqs
    late = Marks(
        published=[seqs[0]],
        failed=[(seqs[1], 60, "late")],
        abandoned=[(seqs[2], "late")],
        untried=[seqs[3]],
    )
    await store.mark("events", stale.token, late)
    stored = await rows_of(mysql_url)
    assert {(r["status"], r["locked_by"], r["attempts"]) for r in stored} == {
        ("processing", "healthy-worker", 2)
    }
    await store.mark("events", fresh.token, late)
    stored = await rows_of(mysql_url)
    assert [(r["status"], r["attempts"], r["last_error"]) for r in stored] == [
        ("published", 2, None),
        ("failed", 2, "late"),
        ("abandoned", 2, "late"),
        ("failed", 1, None),  # untried: not pending, as the stale claim's attempt counts
    ]


async def test_released_rows_are_pending_again_and_their_attempt_does_not_count(
    mysql_url: str, store: MysqlStore
) -> None:
    await stage(mysql_url, "a", "a")
    claim = await store.claim("events", 10, "w1", 30)
    await store.release("events", claim.token, [r.seq for r in claim.rows])
    stored = await rows_of(mysql_url)
    assert [(r["status"], r["attempts"], r["locked_by"]) for r in stored] == [
        ("pending", 0, None),
        ("pending", 0, None),
    ]
    assert await store.next_due("events") is None  # pending: the claim takes them at once
    assert order_ids((await store.claim("events", 10, "w2", 30)).rows) == ["a-0", "a-1"]


async def test_a_paused_target_is_not_claimed_and_circuits_are_recorded(
    mysql_url: str, store: MysqlStore
) -> None:
    await stage(mysql_url, None)
    await mysql_fetch(mysql_url, "INSERT INTO router_targets (target, paused) VALUES ('events', 1)")
    assert (await store.claim("events", 10, "w1", 30)).rows == []
    assert len((await store.claim("partner", 10, "w1", 30)).rows) == 1
    await store.record_circuit("partner", "open", "w1", "connection refused")
    await store.record_circuit("events", "open", "w1", None)
    targets = await mysql_fetch(
        mysql_url,
        "SELECT target, paused, circuit, circuit_worker, circuit_error, circuit_since IS NOT NULL "
        "AS since FROM router_targets ORDER BY target",
    )
    assert [tuple(t.values()) for t in targets] == [
        ("events", 1, "open", "w1", None, 1),
        ("partner", 0, "open", "w1", "connection refused", 1),
    ]
    await store.record_circuit("partner", "closed", "w1", None)
    [partner] = await mysql_fetch(
        mysql_url, "SELECT circuit, circuit_error FROM router_targets WHERE target = 'partner'"
    )
    assert partner == {"circuit": "closed", "circuit_error": None}


async def test_next_due_is_the_earliest_retry_or_lease_end(
    mysql_url: str, store: MysqlStore
) -> None:
    assert await store.next_due("events") is None
    await stage(mysql_url, None, None)
    claim = await store.claim("events", 10, "w1", 5)
    due = await store.next_due("events")
    assert due is not None and 4 < due <= 5  # the lease's end: the rows are claimable again
    first, second = (r.seq for r in claim.rows)
    await store.mark("events", claim.token, Marks(failed=[(first, 0.4, "busy")]))
    due = await store.next_due("events")
    assert due is not None and 0.2 < due <= 0.4
    await store.mark("events", claim.token, Marks(published=[second]))
    await asyncio.sleep(0.45)
    retry = await store.claim("events", 10, "w2", 30)
    await store.mark("events", retry.token, Marks(published=[first]))
    assert await store.next_due("events") is None


async def woken_times(woken: list[float], count: int, within: float) -> None:
    """Wait until the watcher has woken the processors ``count`` times; fail after ``within``
    seconds."""
    deadline = time.monotonic() + within
    while len(woken) < count:
        assert time.monotonic() < deadline, f"woken {len(woken)} times, not {count}"
        await asyncio.sleep(0.02)


async def test_the_watcher_wakes_on_rows_committed_elsewhere(
    mysql_url: str, store: MysqlStore
) -> None:
    woken: list[float] = []
    loop = asyncio.get_running_loop()
    watcher = asyncio.create_task(store.watch(lambda _targets: woken.append(loop.time())))
    try:
        # Its first look wakes everyone once, and the look after it once more (a lower seq
        # may commit late)...
        await woken_times(woken, 2, within=5.0)
        # ...then an idle table wakes no one. An absence has no event to wait for: a quiet
        # second, some twenty looks at the fast pace the poll keeps without the binlog,
        # must bring no third wake.
        await asyncio.sleep(1.0)
        assert len(woken) == 2, f"woken {len(woken)} times with nothing committed"
        await stage(mysql_url, "a")  # another process's commit: no in-process signal
        await woken_times(woken, 3, within=3.0)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


@pytest.mark.parametrize(
    ("version", "refused"),
    [
        ("10.11.19-MariaDB-0+deb12u1", False),
        ("10.6.0-MariaDB", False),
        ("11.4.2-MariaDB-ubu2404", False),
        ("8.0.36", False),
        ("8.4.0-commercial", False),
        ("10.5.27-MariaDB", True),
        ("5.5.5-10.3.39-MariaDB", True),
        ("5.7.44-log", True),
    ],
)
def test_servers_without_skip_locked_are_told_apart(version: str, refused: bool) -> None:
    assert (unsupported_server(version) is not None) == refused


async def test_a_server_without_skip_locked_is_refused_with_its_version(
    mysql_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("router.relay.store.mysql.SERVER_VERSION", "SELECT '10.5.27-MariaDB'")
    old = open_store("main", settings(mysql_url), Path.cwd())
    try:
        for attempt in (old.check_schema(), old.claim("events", 10, "w1", 30)):
            with pytest.raises(DatabaseError) as caught:
                await attempt
            assert str(caught.value) == (
                "main: MariaDB 10.5.27-MariaDB has no SELECT ... FOR UPDATE SKIP LOCKED, which "
                "the router's claim needs; use MariaDB 10.6 or MySQL 8.0 or newer"
            )
    finally:
        await old.close()


async def test_an_unreachable_server_is_a_database_error() -> None:
    store = open_store("main", settings("mysql://root@127.0.0.1:1/nowhere"), Path.cwd())
    try:
        with pytest.raises(DatabaseError, match="^main: cannot connect: "):
            await store.check_schema()
    finally:
        await store.close()


def test_a_missing_driver_names_the_database_and_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("router._db.MYSQL_DRIVER", "no_such_mysql_driver")
    config = make_config({"orders": "mysql://root@127.0.0.1/x"}, BROKERS)
    expected = (
        "databases.orders: a MySQL or MariaDB database needs the no_such_mysql_driver driver "
        "(no_such_mysql_driver is not installed): pip install 'outbox-router[mysql]'"
    )
    with pytest.raises(ConfigError) as caught:
        open_store("orders", config.databases["orders"], Path.cwd())
    assert str(caught.value) == expected
    with pytest.raises(ConfigError, match=r"pip install 'outbox-router\[mysql\]'"):
        Outbox(config).engine()


def test_loading_a_mysql_config_imports_no_driver() -> None:
    code = (
        "import sys, router, router.cli.main\n"
        "router.parse_config('databases: {main: mariadb://u@h/db}\\n"
        "brokers: {events: {type: memory, internal: true}}\\n')\n"
        "print('asyncmy' in sys.modules)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "False"
    assert (
        parse_config(
            "databases: {main: mariadb://u@h/db}\nbrokers: {events: {type: memory, internal: true}}\n"
        )
        .databases["main"]
        .kind
        == "mysql"
    )
