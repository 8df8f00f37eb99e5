"""`router check` warns when PostgreSQL cannot clean the outbox or the claim left its indexes."""

from __future__ import annotations

import asyncio

import asyncpg

from router.ops.pg_health import postgres_warnings
from tests.conftest import PgDatabases


async def test_an_open_transaction_holding_the_xmin_horizon_is_named_until_it_ends(
    pg_databases: PgDatabases,
) -> None:
    url = await pg_databases.new()
    assert await postgres_warnings(url, ["events"], xmin_limit=0.5) == []
    holder = await asyncpg.connect(url, server_settings={"application_name": "nightly-report"})
    try:
        transaction = holder.transaction(isolation="repeatable_read")
        await transaction.start()
        await holder.fetchval("SELECT count(*) FROM router_outbox")  # takes the snapshot
        await asyncio.sleep(1.2)
        [warning] = await postgres_warnings(url, ["events"], xmin_limit=0.5)
        pid = holder.get_server_pid()
        assert warning.startswith("xmin horizon held for 1 s by ")
        assert f"pid {pid} (nightly-report), idle in transaction" in warning
        assert "VACUUM can remove no dead row version" in warning
        await transaction.commit()
        assert await postgres_warnings(url, ["events"], xmin_limit=0.5) == []
    finally:
        await holder.close()


async def test_a_claim_that_lost_its_index_is_reported_with_the_scan_it_would_make(
    pg_databases: PgDatabases,
) -> None:
    url = await pg_databases.new()
    assert await postgres_warnings(url, ["events", "partner"]) == []
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("DROP INDEX ix_router_outbox_stream")
    finally:
        await conn.close()
    warnings = await postgres_warnings(url, ["events", "partner"])
    assert [w.split(" is not index-served")[0] for w in warnings] == [
        "the claim of target 'events'",
        "the claim of target 'partner'",
    ]
    assert "on router_outbox_q0 p" in warnings[0]  # the stream check's scan, as planned now
    assert "check that ix_router_outbox_claim and ix_router_outbox_stream exist" in warnings[0]
