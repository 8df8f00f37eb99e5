"""PostgreSQL's stage-time stream locks: a transaction on any number of stream keys holds a
bounded number of advisory locks (``STREAM_LOCK_SLOTS``), and a key's lock is the same in
every statement form, so per-key commit order holds between a one-key transaction and a
many-key one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import psycopg2
import pytest
from sqlalchemy.ext.asyncio import AsyncConnection

from router import Outbox, SyncOutbox
from router.write.postgres import STREAM_LOCK_NAMESPACE, STREAM_LOCK_SLOTS
from tests.conftest import PgDatabases, make_config
from tests.integration.events import StockReserved

BROKERS = {"events": {"type": "memory", "internal": True}}  # one row per event

# Three times what PostgreSQL's default lock table holds for the whole server (64 x 100).
MANY = 20_000

HELD = """
SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND pid = %s AND classid = %s::bigint::oid AND objsubid = 2
"""


def held_locks(url: str, pid: int) -> int:
    """The stream locks the backend ``pid`` holds."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(HELD, (pid, STREAM_LOCK_NAMESPACE)).fetchone()
        assert row is not None
        return int(row[0])


def staged_keys(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT stream_key FROM router_outbox ORDER BY seq")]


def many_events() -> tuple[list[StockReserved], list[str | None]]:
    keys: list[str | None] = [f"key-{n}" for n in range(MANY)]
    return [StockReserved(order_id=str(n), quantity=n) for n in range(MANY)], keys


async def via_asyncpg(url: str) -> int:
    """The raw asyncpg path (one unnest INSERT, positional parameters); the locks held."""
    outbox, (events, keys) = Outbox(make_config({"main": url}, BROKERS)), many_events()
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            await outbox.stage(conn, *events, stream_keys=keys)
            return held_locks(url, await conn.fetchval("SELECT pg_backend_pid()"))
    finally:
        await conn.close()


async def via_async_connection(url: str) -> int:
    """A SQLAlchemy AsyncConnection (the unnest INSERT, named parameters); the locks held."""
    outbox, (events, keys) = Outbox(make_config({"main": url}, BROKERS)), many_events()
    try:
        conn: AsyncConnection
        async with outbox.engine().begin() as conn:
            await outbox.stage(conn, *events, stream_keys=keys)
            pid = (await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar_one()
            return held_locks(url, pid)
    finally:
        await outbox.close()


async def via_psycopg(url: str) -> int:
    """SyncOutbox on psycopg 3 (the locks' statement, then COPY); the locks held."""
    outbox, (events, keys) = SyncOutbox(make_config({"main": url}, BROKERS)), many_events()
    with psycopg.connect(url) as conn:
        outbox.stage(conn, *events, stream_keys=keys)
        return held_locks(url, conn.info.backend_pid)


async def via_psycopg2(url: str) -> int:
    """SyncOutbox on psycopg2 (the unnest INSERT, bound on the client); the locks held."""
    outbox, (events, keys) = SyncOutbox(make_config({"main": url}, BROKERS)), many_events()
    conn = psycopg2.connect(url)
    try:
        with conn:
            outbox.stage(conn, *events, stream_keys=keys)
            return held_locks(url, conn.get_backend_pid())
    finally:
        conn.close()


@pytest.mark.parametrize(
    "stage_many",
    [via_asyncpg, via_async_connection, via_psycopg, via_psycopg2],
    ids=lambda f: f.__name__,
)
async def test_one_transaction_stages_20000_stream_keys_holding_at_most_1024_locks(
    pg_url: str, stage_many: Callable[[str], Any]
) -> None:
    # A lock per key took 20,000 of the server's 6,400 lock entries: "out of shared memory",
    # the transaction lost, and other sessions' locks refused meanwhile.
    held = await stage_many(pg_url)
    assert 0 < held <= STREAM_LOCK_SLOTS
    assert staged_keys(pg_url) == [f"key-{n}" for n in range(MANY)]


@contextmanager
def transaction(url: str, **options: Any) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(url, **options) as conn:  # commits, or rolls back on error
        yield conn


@pytest.mark.parametrize("first", ["one-key", "many-key"])
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "simple-query"])
async def test_a_one_key_and_a_many_key_transaction_on_a_shared_key_take_turns(
    pg_databases: PgDatabases, tmp_path: Path, first: str, prepared: bool
) -> None:
    # The one-key transaction stages in the small form (prepared, or the simple query that
    # Django's default connection sends), the many-key one by COPY: both lock "shared" the
    # same way, so the second waits for the first's commit and gets the later seq.
    url = await pg_databases.new()
    outbox = SyncOutbox(make_config({"main": url}, BROKERS, base_dir=tmp_path))
    many_keys = [f"other-{n}" for n in range(199)] + ["shared"]
    small_options = {} if prepared else {"prepare_threshold": None}
    staged, release, second_done = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def one_key() -> None:
        with transaction(url, **small_options) as conn:
            outbox.stage(conn, StockReserved(order_id="one-key", quantity=0), stream_key="shared")
            hold_or_finish(first == "one-key")

    def many_key() -> None:
        events = [StockReserved(order_id=f"many-key {key}", quantity=1) for key in many_keys]
        with transaction(url) as conn:
            outbox.stage(conn, *events, stream_keys=many_keys)
            hold_or_finish(first == "many-key")

    def hold_or_finish(holds: bool) -> None:
        if holds:
            staged.set()
            release.wait(10)
        else:
            second_done.set()

    def run(body: Callable[[], None], wait: bool) -> Callable[[], None]:
        def target() -> None:
            try:
                if wait:
                    staged.wait(10)
                body()
            except BaseException as exc:  # reported below
                errors.append(exc)

        return target

    threads = [
        threading.Thread(target=run(one_key, first != "one-key")),
        threading.Thread(target=run(many_key, first != "many-key")),
    ]
    for thread in threads:
        thread.start()
    assert staged.wait(10)
    assert not second_done.wait(0.5), "the second transaction did not wait for the first"
    release.set()
    for thread in threads:
        thread.join(15)
    assert errors == []
    shared = [
        key
        for key in staged_rows(url)
        if key in {"one-key", "many-key shared"}  # the two rows on "shared", in seq order
    ]
    assert shared == (
        ["one-key", "many-key shared"] if first == "one-key" else ["many-key shared", "one-key"]
    )


def staged_rows(url: str) -> list[str]:
    """Every row's order id, in seq order."""
    with psycopg.connect(url, autocommit=True) as conn:
        query = "SELECT envelope->'payload'->>'order_id' FROM router_outbox ORDER BY seq"
        return [r[0] for r in conn.execute(query)]
