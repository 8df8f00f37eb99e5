"""The chaos runs crash a PostgreSQL server of their own, never the shared one on 5432: a
crash there would cut every other test and session on the machine."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import asyncpg

from tests.chaos.databases import Postgres, chaos_database
from tests.conftest import PG_ADMIN
from tests.private_postgres import PrivatePostgres, require_postgres_programs
from tests.services import POSTGRES, reachable, require


async def started_at(url: str) -> datetime:
    """The server's ``pg_postmaster_start_time()``."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        started: datetime = await conn.fetchval("SELECT pg_postmaster_start_time()")
        return started
    finally:
        await conn.close()


async def test_a_chaos_crash_recovers_the_private_server_and_leaves_the_shared_one_up(
    private_postgres: PrivatePostgres, tmp_path: Path
) -> None:
    require("PostgreSQL", POSTGRES)
    shared = await started_at(PG_ADMIN)
    db = chaos_database("postgresql", tmp_path, private_postgres)
    await db.create()
    try:
        before = await started_at(db.url)
        await db.crash()
        assert await started_at(db.url) > before  # it did crash and come back, recovered
        await private_postgres.execute("CREATE TABLE survived (id int)", database=db.name)
    finally:
        await db.drop()
    assert db.url.startswith(f"postgresql://postgres@127.0.0.1:{private_postgres.port}/")
    assert await started_at(PG_ADMIN) == shared


async def test_a_run_without_a_session_server_starts_one_and_removes_it() -> None:
    require_postgres_programs()
    db = Postgres(Path("unused"))
    await db.create()
    folder, port = db.server.folder, db.server.port
    assert reachable("127.0.0.1", port)
    await db.drop()
    assert not folder.exists()
    assert not reachable("127.0.0.1", port)
