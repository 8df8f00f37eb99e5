"""``router serve`` on a database without the router's tables, or with older ones, refuses to
start with exit code 2 and says to run ``router init-db`` (instead of failing every claim)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from alembic import command
from sqlalchemy import Connection

from router import Runner, SchemaError, load_config
from router._db import create_engine
from router.config import DatabaseSettings
from router.ops.migrate import _alembic_config, head_revision
from tests.conftest import NATS_URL, PgDatabases, pg_fetch
from tests.e2e.helpers import router

HEAD = head_revision()


def write_config(folder: Path, url: str) -> Path:
    path = folder / "config.yaml"
    broker = {
        "type": "nats",
        "url": NATS_URL,
        "internal": True,
        "destination": "schematest.{event_type}",
        "stream": {"name": "SCHEMATEST", "subjects": ["schematest.>"], "storage": "memory"},
    }
    config = {
        "service": "shop",
        "databases": {"main": url},
        "brokers": {"events": broker},
        "http": {"enabled": False},
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def migrate_to(url: str, revision: str) -> None:
    def upgrade(connection: Connection) -> None:
        config = _alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, revision)

    engine = create_engine(DatabaseSettings.model_validate({"url": url}), Path.cwd())
    try:
        async with engine.begin() as conn:
            await conn.run_sync(upgrade)
    finally:
        await engine.dispose()


async def tables(url: str) -> list[str]:
    rows = await pg_fetch(
        url, "SELECT tablename FROM pg_tables WHERE tablename LIKE 'router%' ORDER BY 1"
    )
    return [r[0] for r in rows]


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_serve_on_a_database_without_tables_exits_2(
    pg_databases: PgDatabases, tmp_path: Path, workers: str
) -> None:
    url = await pg_databases.new(migrated=False)
    write_config(tmp_path, url)
    result = await asyncio.to_thread(router, "serve", "--workers", workers, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "router: database 'main' has no router tables; run `router init-db` first"
    )
    assert await tables(url) == []  # serve created nothing


async def test_serve_on_an_older_schema_exits_2_and_names_both_revisions(
    pg_databases: PgDatabases, tmp_path: Path
) -> None:
    url = await pg_databases.new(migrated=False)
    await migrate_to(url, "0005")
    write_config(tmp_path, url)
    result = await asyncio.to_thread(router, "serve", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"router: database 'main' is at schema 0005, this router needs {HEAD}; "
        "run `router init-db` to upgrade it"
    )
    init = await asyncio.to_thread(router, "init-db", cwd=tmp_path)
    assert f"main: upgraded 0005 -> {HEAD}" in init.stdout


def test_serve_on_a_new_sqlite_file_exits_2(tmp_path: Path) -> None:
    write_config(tmp_path, "sqlite:///outbox.db")
    result = router("serve", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "database 'main' has no router tables; run `router init-db` first" in result.stderr


async def test_the_library_supervisor_raises_schema_error(
    pg_databases: PgDatabases, tmp_path: Path
) -> None:
    url = await pg_databases.new(migrated=False)
    config = load_config(write_config(tmp_path, url))
    with pytest.raises(SchemaError, match="run `router init-db` first"):
        await Runner(config, start_embedded=False).run(asyncio.Event())


def test_the_revision_the_stores_expect_is_the_newest_migration() -> None:
    from router.relay.store import SCHEMA_REVISION

    assert SCHEMA_REVISION == HEAD
