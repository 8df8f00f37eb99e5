"""Which rows ``stage()`` puts in one unit for an ``atomic`` target, and the unit's size
checked at ``stage()``, on PostgreSQL, SQLite and MariaDB.

A unit is one application transaction's rows: two transactions through one SQLAlchemy
connection (sync or async) are two units, one transaction's several ``stage()`` calls one; a
raw sqlite3 connection shows no transaction, so there each call is one. A transaction that
would stage more rows for an atomic target than its broker's atomic write holds (the memory
broker's 1,000) is refused at the call that would cross it, in the caller's transaction, which
goes on; a target without ``atomic`` takes any number.
"""

from __future__ import annotations

import sqlite3
from decimal import Decimal
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy as sa

from router import Outbox, StagingError, SyncOutbox
from tests.conftest import Database, make_config
from tests.integration.events import OrderPlaced
from tests.integration.test_sync_writer import sa_url

ATOMIC = {"events": {"type": "memory", "internal": True, "atomic": True}}
PLAIN = {"events": {"type": "memory", "internal": True}}
SYNC_DRIVERS = {"postgresql": "psycopg", "mysql": "pymysql", "sqlite": "pysqlite"}
LIMIT = 1000  # MemorySettings.max_unit


def orders(*numbers: int) -> list[OrderPlaced]:
    return [OrderPlaced(order_id=str(n), total=Decimal(n)) for n in numbers]


def sync_outbox(database: Database, brokers: dict[str, Any] = ATOMIC) -> SyncOutbox:
    return SyncOutbox(make_config({"main": database.url}, brokers, database.base_dir))


async def units(database: Database) -> dict[str, str | None]:
    """Each row's unit (its ``xid``, as text), by message id."""
    xid = {"postgresql": "xid::text", "mysql": "CAST(xid AS CHAR)"}.get(database.kind, "xid")
    found = await database.fetch(f"SELECT message_id, {xid} AS xid FROM router_outbox")
    return {str(r["message_id"]): None if r["xid"] is None else str(r["xid"]) for r in found}


async def count(database: Database) -> int:
    [row] = await database.fetch("SELECT count(*) AS n FROM router_outbox")
    return int(row["n"])


async def test_two_transactions_of_one_sqlalchemy_connection_are_two_units(
    database: Database,
) -> None:
    outbox = sync_outbox(database)
    engine = sa.create_engine(sa_url(database, SYNC_DRIVERS[database.kind]))
    try:
        with engine.connect() as conn:
            first = outbox.stage(conn, *orders(1))
            conn.commit()
            second = outbox.stage(conn, *orders(2))
            second += outbox.stage(conn, *orders(3), stream_key="k")
            conn.commit()
    finally:
        engine.dispose()
    found = await units(database)
    assert None not in found.values()
    assert found[second[0]] == found[second[1]] != found[first[0]]


async def test_two_transactions_of_one_async_connection_are_two_units(
    database: Database,
) -> None:
    outbox = Outbox(make_config({"main": database.url}, ATOMIC, database.base_dir))
    try:
        async with outbox.engine().connect() as conn:
            first = await outbox.stage(conn, *orders(1))
            await conn.commit()
            second = await outbox.stage(conn, *orders(2))
            second += await outbox.stage(conn, *orders(3))
            await conn.commit()
        async with outbox.transaction() as tx:
            third = await tx.stage(*orders(4))
            third += await tx.stage(*orders(5))
    finally:
        await outbox.close()
    found = await units(database)
    assert found[second[0]] == found[second[1]] != found[first[0]]
    assert found[third[0]] == found[third[1]] not in {found[first[0]], found[second[0]]}


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
async def test_each_call_on_a_raw_sqlite3_connection_is_a_unit(database: Database) -> None:
    outbox = sync_outbox(database)
    conn = sqlite3.connect(database.base_dir / "outbox.db", timeout=10)
    try:
        with conn:
            first = outbox.stage(conn, *orders(1, 2))
            second = outbox.stage(conn, *orders(3))
    finally:
        conn.close()
    found = await units(database)
    assert found[first[0]] == found[first[1]] != found[second[0]]


@pytest.mark.parametrize("database", ["sqlite", "mysql"], indirect=True)
async def test_rows_of_targets_without_atomic_have_no_unit(database: Database) -> None:
    brokers = {**ATOMIC, "partner": {"type": "memory"}}
    outbox = Outbox(make_config({"main": database.url}, brokers, database.base_dir))
    try:
        async with outbox.transaction() as tx:
            await tx.stage(*orders(1))
    finally:
        await outbox.close()
    rows = await database.fetch("SELECT target, xid FROM router_outbox ORDER BY target")
    assert [(r["target"], r["xid"] is None) for r in rows] == [
        ("events", False),
        ("partner", True),
    ]


async def test_a_transaction_larger_than_the_atomic_write_is_refused_at_stage(
    database: Database,
) -> None:
    """1,000 rows in one call go; the 1,001st, a call later, is refused naming the target, its
    limit and the count; the transaction goes on and commits its 1,000. The next transaction
    starts again from none, and 1,001 rows in one call are refused with nothing written."""
    outbox = Outbox(make_config({"main": database.url}, ATOMIC, database.base_dir))
    try:
        async with outbox.transaction() as tx:
            await tx.stage(*orders(*range(LIMIT)))
            with pytest.raises(StagingError) as refused:
                await tx.stage(*orders(LIMIT))
            await tx.stage()  # nothing: the transaction is still usable
        assert await count(database) == LIMIT
        assert "1,001 rows for broker 'events'" in str(refused.value)
        assert "at most 1,000 messages" in str(refused.value)
        async with outbox.transaction() as tx:
            await tx.stage(*orders(1))
            with pytest.raises(StagingError, match="1,001 rows for broker 'events'"):
                await tx.stage(*orders(*range(LIMIT)))
        assert await count(database) == LIMIT + 1
    finally:
        await outbox.close()


async def test_a_target_without_atomic_takes_any_number(database: Database) -> None:
    outbox = Outbox(make_config({"main": database.url}, PLAIN, database.base_dir))
    try:
        async with outbox.transaction() as tx:
            await tx.stage(*orders(*range(LIMIT)))
            await tx.stage(*orders(LIMIT))
    finally:
        await outbox.close()
    assert await count(database) == LIMIT + 1


@pytest.mark.parametrize("database", ["postgresql"], indirect=True)
async def test_raw_postgresql_connections_count_the_transactions_rows(
    database: Database,
) -> None:
    """psycopg and asyncpg: the client cannot tell their transactions apart, so stage()
    counts the transaction's rows of the target (its xid) before it adds more."""
    outbox = sync_outbox(database)
    with psycopg.connect(database.url) as conn:
        outbox.stage(conn, *orders(*range(LIMIT - 1)))
        outbox.stage(conn, *orders(LIMIT - 1))
        with pytest.raises(StagingError, match="1,001 rows for broker 'events'"):
            outbox.stage(conn, *orders(LIMIT))
    async_outbox = Outbox(outbox.config)
    raw = await asyncpg.connect(database.url)
    try:
        async with raw.transaction():
            await async_outbox.stage(raw, *orders(1))
            with pytest.raises(StagingError, match="1,001 rows for broker 'events'"):
                await async_outbox.stage(raw, *orders(*range(LIMIT)))
    finally:
        await raw.close()
    assert await count(database) == LIMIT + 1
