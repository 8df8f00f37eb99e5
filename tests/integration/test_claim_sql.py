"""The claim and mark the migrations install are exactly router/relay/store/postgres_sql.py's."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from router._wakeup import WAKE_LOCK_NAMESPACE
from router.config import DatabaseSettings
from router.ops.migrate import migrate_to, upgrade
from router.relay.store.base import OPEN_STATUSES
from router.relay.store.postgres_ring import RING_LOCK
from router.relay.store.postgres_sql import CLAIM_FUNCTION, CLAIM_LOCK_NAMESPACE, MARK_FUNCTION
from router.write.postgres import STREAM_LOCK_NAMESPACE
from tests.conftest import PgDatabases

DEFINITIONS = """
SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid)
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'public' AND p.proname IN ('router_claim', 'router_mark')
ORDER BY 1
"""


async def definitions(url: str, *statements: str) -> list[tuple[str, str]]:
    """Run ``statements`` on the database at ``url``; PostgreSQL's text of its claim and mark
    (every overload, so a function a migration forgot to drop shows up too)."""
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
        return [(r[0], r[1]) for r in await conn.fetch(DEFINITIONS)]
    finally:
        await conn.close()


async def test_the_migrations_install_the_claim_and_mark_of_postgres_sql(
    pg_databases: PgDatabases,
) -> None:
    migrated = await pg_databases.new(migrated=False)
    await upgrade("migrated", DatabaseSettings.model_validate({"url": migrated}), Path.cwd())
    # The module's text, created the same way in an empty database: PostgreSQL prints both
    # in its own layout, so only what the functions are counts (bodies byte for byte).
    scratch = await pg_databases.new(migrated=False)
    expected = await definitions(scratch, CLAIM_FUNCTION, MARK_FUNCTION)
    assert [signature for signature, _ in expected] == [
        "router_claim(text,integer,text,double precision,boolean,bigint)",
        "router_mark(bigint[],text[],bigint[],double precision[],text[],bigint[],text[],text,"
        "text[],text[],bigint[],text[],bigint[],text[])",
    ]
    assert await definitions(migrated) == expected


async def test_a_downgrade_to_0021_puts_back_the_mark_it_had(pg_databases: PgDatabases) -> None:
    # 0022 rewrote the mark (one plan a session, the gaps closed by a hash of their ids); going
    # back to 0021 puts back 0017's text, settings included.
    url = await pg_databases.new(migrated=False)
    settings = DatabaseSettings.model_validate({"url": url})
    await migrate_to("db", settings, Path.cwd(), "0021")
    at_0021 = await definitions(url)
    await upgrade("db", settings, Path.cwd())
    upgraded = await definitions(url)
    assert "plan_cache_mode" not in at_0021[1][1]
    assert "plan_cache_mode TO 'force_generic_plan'" in upgraded[1][1]
    await migrate_to("db", settings, Path.cwd(), "0021")
    assert await definitions(url) == at_0021


def test_the_claim_reads_queued_rows_and_checks_streams_against_rows_in_flight() -> None:
    # Word for word the predicates of ix_router_outbox_claim and ix_router_outbox_stream
    # (migrations 0008 and 0017): the claim index leaves 'processing' out, so only the stream
    # index can answer the stream check; held and parked rows hold their streams back too.
    assert "o.status IN ('pending', 'failed')\n" in CLAIM_FUNCTION
    assert "f.status IN ('pending', 'failed')" in CLAIM_FUNCTION
    assert CLAIM_FUNCTION.count("p.status IN ('processing', 'failed', 'held', 'parked')") == 2
    assert set(OPEN_STATUSES) == {"pending", "processing", "failed"}
    assert f"pg_try_advisory_xact_lock({CLAIM_LOCK_NAMESPACE}, " in CLAIM_FUNCTION
    # Each advisory lock of the router has a first key of its own (a shared one made an idle
    # relay's wake lock block every claim of its target).
    namespaces = [CLAIM_LOCK_NAMESPACE, STREAM_LOCK_NAMESPACE, WAKE_LOCK_NAMESPACE, RING_LOCK[0]]
    assert len(set(namespaces)) == len(namespaces)
