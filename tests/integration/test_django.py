"""``router.contrib.django`` on a real Django, on PostgreSQL (psycopg 3), MariaDB (PyMySQL)
and SQLite: each scenario runs the test project (tests/integration/django_app) in a process
of its own, as Django's settings are global to a process, against a fresh router database;
the test asserts on what the process printed and on what the database holds.

Each kind: an order and its event commit together (a row per target), an exception in the
``atomic()`` block leaves neither, staging outside one is refused, a second alias stages in
its own transaction, and ``manage.py check --database default`` (and ``migrate``) fails
(``router.E001``) on a database without the router's tables or behind them, and passes at head
and after ``init_db()``; on a database without them, ``stage()`` is refused naming
``router init-db`` and the block goes on to commit its own rows. Once, on SQLite: the check's
other two errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from router.config import DatabaseSettings
from router.ops.migrate import head_revision, migrate_to
from tests.conftest import MEMORY_BROKERS, Database, MysqlDatabases, PgDatabases, make_database
from tests.integration.events import NO_TABLES

ROOT = Path(__file__).resolve().parents[2]
HEAD = head_revision()
KINDS = ["postgresql", "mysql", "sqlite"]


def django_database(database: Database) -> dict[str, Any]:
    """The ``DATABASES`` entry for the same database as ``database``."""
    if database.kind == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(database.base_dir / database.url.removeprefix("sqlite:///")),
        }
    name = database.url.rpartition("/")[2]
    if database.kind == "postgresql":
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": "postgres",
            "HOST": "127.0.0.1",
            "PORT": "5432",
        }
    return {
        "ENGINE": "django.db.backends.mysql",
        "NAME": name,
        "USER": "root",
        "PASSWORD": "",
        "HOST": "127.0.0.1",
        "PORT": "3306",
    }


@dataclass
class Project:
    """The test project on one fresh database; ``config.yaml`` in ``database.base_dir``."""

    database: Database

    def env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.integration.django_app.settings",
            "ROUTER_TEST_DJANGO_DB": json.dumps(django_database(self.database)),
            "ROUTER_TEST_BASE_DIR": str(self.database.base_dir),
            "PYTHONPATH": str(ROOT),
        }
        env.pop("ROUTER_CONFIG", None)  # the setting (relative to BASE_DIR) must be what counts
        return env

    def python(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def run(self, *steps: str) -> dict[str, dict[str, Any]]:
        """Run scenario steps in one process; ``{step: what it printed}``."""
        done = self.python("-m", "tests.integration.django_app.scenario", *steps)
        assert done.returncode == 0, done.stderr
        printed = [json.loads(line) for line in done.stdout.splitlines()]
        return {line.pop("step"): line for line in printed}

    def check(self) -> subprocess.CompletedProcess[str]:
        """``manage.py check --database default``."""
        return self.python("-m", "django", "check", "--database", "default")

    async def orders(self) -> list[int]:
        found = await self.database.fetch("SELECT id FROM orders_order ORDER BY id")
        return [int(row["id"]) for row in found]


def write_config(database: Database, brokers: dict[str, Any] = MEMORY_BROKERS) -> None:
    """``config.yaml`` with this database as ``main`` and another of its kind as ``archive``,
    so the Django alias must be matched to ``main`` by where it points."""
    archive = (
        "sqlite:///archive.db"
        if database.kind == "sqlite"
        else database.url.rpartition("/")[0] + "/router_archive"
    )
    config = {
        "service": "shop",
        "databases": {"archive": archive, "main": database.url},
        "brokers": brokers,
        "http": {"enabled": False},
    }
    (database.base_dir / "config.yaml").write_text(json.dumps(config))  # JSON is YAML


@pytest.fixture(params=KINDS)
async def project(
    request: pytest.FixtureRequest,
    pg_databases: PgDatabases,
    mysql_databases: MysqlDatabases,
    tmp_path: Path,
) -> Project:
    """The test project on a fresh database at the router's head revision."""
    database = await make_database(request.param, pg_databases, mysql_databases, tmp_path)
    write_config(database)
    return Project(database)


@pytest.fixture(params=KINDS)
async def bare_project(
    request: pytest.FixtureRequest,
    pg_databases: PgDatabases,
    mysql_databases: MysqlDatabases,
    tmp_path: Path,
) -> Project:
    """The test project on a fresh database without the router's tables."""
    kind = request.param
    if kind == "postgresql":
        url = await pg_databases.new(migrated=False)
    elif kind == "mysql":
        url = await mysql_databases.new(migrated=False)
    else:
        url = "sqlite:///outbox.db"
    database = Database(kind, url, tmp_path)
    write_config(database)
    return Project(database)


async def test_an_order_and_its_event_commit_together(project: Project) -> None:
    done = project.run("migrate", "commit")["commit"]
    order, ids = done["order"], done["ids"]

    assert await project.orders() == [order]
    rows = await project.database.rows()
    assert [r["target"] for r in rows] == ["events", "analytics", "billing"]
    assert {r["message_id"] for r in rows} == set(ids)
    assert len(ids) == 1
    assert {r["stream_key"] for r in rows} == {str(order)}
    assert {r["status"] for r in rows} == {"pending"}
    envelope = rows[0]["envelope"]
    assert envelope["payload"] == {"order_id": str(order), "total": "9.50", "note": None}
    assert envelope["correlation_id"] == "req-1"


async def test_each_outermost_atomic_block_is_one_unit(project: Project) -> None:
    """With ``atomic: true``: a decorated view's two calls are two units; one block with a
    savepoint rolled back between its two orders is one."""
    database = project.database
    atomic = {**MEMORY_BROKERS, "events": {**MEMORY_BROKERS["events"], "atomic": True}}
    write_config(database, atomic)
    done = project.run("migrate", "units")["units"]
    xid = {"postgresql": "xid::text", "mysql": "CAST(xid AS CHAR)"}.get(database.kind, "xid")
    found = await database.fetch(
        f"SELECT message_id, {xid} AS xid FROM router_outbox WHERE target = 'events'"
    )
    unit = {str(r["message_id"]): r["xid"] for r in found}
    assert len(unit) == 4 and None not in unit.values()
    [first], [second], both = done["first"], done["second"], done["both"]
    assert len({unit[first], unit[second], unit[both[0]]}) == 3
    assert unit[both[0]] == unit[both[1]]


async def test_an_exception_in_the_block_leaves_neither(project: Project) -> None:
    done = project.run("migrate", "rollback")["rollback"]
    assert done["raised"] == "business rule"
    assert len(done["ids"]) == 1  # staged, then rolled back with the order

    assert await project.orders() == []
    assert await project.database.rows() == []


async def test_staging_outside_atomic_is_refused(project: Project) -> None:
    done = project.run("migrate", "outside")["outside"]
    assert done["error"] == (
        "stage() needs the connection inside a transaction, but Django's connection "
        "'default' is outside transaction.atomic(), so each statement would commit on its "
        "own, apart from the caller's work; stage inside `with transaction.atomic():` "
        "(or ATOMIC_REQUESTS)"
    )
    assert await project.database.rows() == []


async def test_a_named_alias_stages_in_its_own_transaction(project: Project) -> None:
    done = project.run("migrate", "other")["other"]
    assert done["default_in_block"] is False  # the block was other's, not default's

    assert await project.orders() == [done["order"]]
    rows = await project.database.rows()
    assert [r["target"] for r in rows] == ["events", "analytics", "billing"]
    assert {r["message_id"] for r in rows} == set(done["ids"])


async def test_a_large_batch_goes_in_whole_and_in_order(project: Project) -> None:
    done = project.run("batch")["batch"]
    rows = await project.database.rows()
    assert [r["message_id"] for r in rows] == done["ids"]
    assert [r["stream_key"] for r in rows] == done["keys"]
    assert [r["envelope"]["payload"]["order_id"] for r in rows] == done["order_ids"]


async def test_a_models_raised_events_are_staged_with_its_save_once(project: Project) -> None:
    done = project.run("migrate", "entity")["entity"]
    assert done["waiting"] == 0
    rows = [r for r in await project.database.rows() if r["target"] == "events"]
    assert [(r["event_type"], r["stream_key"]) for r in rows] == [
        ("stock_reserved", str(done["shipment"])),  # the model's primary key
        ("order_placed", "o-7"),  # raised with its own stream key
    ]
    shipments = await project.database.fetch("SELECT quantity FROM orders_shipment")
    assert [row["quantity"] for row in shipments] == [3]


async def test_a_models_events_roll_back_with_its_block(project: Project) -> None:
    done = project.run("migrate", "entity_rollback")["entity_rollback"]
    assert done["raised"] == "business rule"
    assert await project.database.rows() == []
    assert await project.database.fetch("SELECT id FROM orders_shipment") == []


async def test_a_retried_save_stages_what_the_rollback_took(project: Project) -> None:
    done = project.run("migrate", "entity_retry")["entity_retry"]
    assert done["waiting"] == 1  # put back by the rollback
    rows = [r for r in await project.database.rows() if r["target"] == "events"]
    assert [r["stream_key"] for r in rows] == [str(pk) for pk in done["shipments"]]


async def test_bulk_writes_of_models_with_events_waiting_are_refused(project: Project) -> None:
    done = project.run("migrate", "entity_bulk")["entity_bulk"]
    assert [error.split("(")[0] for error in done["errors"]] == [
        "Shipment None has 1 raised event",
        f"Shipment {done['saved']} has 1 raised event",
    ]
    assert "bulk_create() saves no model one by one" in done["errors"][0]
    assert "bulk_update() saves no model one by one" in done["errors"][1]
    assert done["waiting"] == [1, 1]
    assert await project.database.rows() == []
    shipments = await project.database.fetch("SELECT id, quantity FROM orders_shipment")
    assert [(row["id"], row["quantity"]) for row in shipments] == [(done["saved"], 1)]


async def test_a_model_dropped_with_events_waiting_is_logged(project: Project) -> None:
    done = project.run("migrate", "entity_update")["entity_update"]
    assert done["logged"] == ["router.entity.events_unstaged"]
    assert await project.database.rows() == []


async def test_the_check_passes_at_head(project: Project) -> None:
    checked = project.check()
    assert checked.returncode == 0, checked.stderr
    assert "System check identified no issues" in checked.stdout


async def test_the_check_fails_without_the_router_tables_until_init_db(
    bare_project: Project,
) -> None:
    checked = bare_project.check()
    assert checked.returncode == 1, checked.stdout
    assert (
        "(router.E001) Django database 'default' (router database 'main') has no router tables"
    ) in checked.stderr
    assert "HINT: run `router init-db`" in checked.stderr
    # migrate runs the database checks too: the router's tables come first
    migrate = bare_project.python("-m", "django", "migrate")
    assert migrate.returncode == 1
    assert "(router.E001)" in migrate.stderr

    done = bare_project.run("init_db")["init_db"]
    assert done == {"before": None, "after": HEAD, "revision": HEAD}
    checked = bare_project.check()
    assert checked.returncode == 0, checked.stderr

    # One revision behind: what a deploy of a newer router without `router init-db` sees.
    database = bare_project.database
    previous = f"{int(HEAD or 0) - 1:04d}"
    settings = DatabaseSettings.model_validate({"url": database.url})
    await migrate_to("main", settings, database.base_dir, previous)
    checked = bare_project.check()
    assert checked.returncode == 1, checked.stdout
    assert (
        f"(router.E001) Django database 'default' (router database 'main') is at router "
        f"schema {previous}; this router needs {HEAD}"
    ) in checked.stderr


async def test_staging_without_the_router_tables_is_refused_and_the_block_goes_on(
    bare_project: Project,
) -> None:
    # On PostgreSQL too: stage() asked for the tables before an INSERT that would have
    # failed and aborted the block's transaction.
    done = bare_project.run("migrate_bare", "refused")["refused"]
    assert done["error"] == NO_TABLES
    assert await bare_project.orders() == done["orders"]


@pytest.mark.parametrize("bare_project", ["sqlite"], indirect=True)
async def test_the_check_reports_a_config_it_cannot_read(bare_project: Project) -> None:
    config = bare_project.database.base_dir / "config.yaml"
    config.unlink()
    checked = bare_project.check()
    assert checked.returncode == 1, checked.stdout
    assert (
        f"(router.E002) the router's config cannot be read: {config}: config file not found"
    ) in checked.stderr


async def test_the_check_reports_a_database_it_cannot_read(tmp_path: Path) -> None:
    project = Project(Database("sqlite", "sqlite:///missing/outbox.db", tmp_path))
    write_config(project.database)
    checked = project.check()
    assert checked.returncode == 1, checked.stdout
    assert (
        "(router.E003) cannot read the router schema of database 'default': "
        "OperationalError: unable to open database file"
    ) in checked.stderr
