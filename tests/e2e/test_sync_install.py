"""A sync application's install: a fresh copy of the project in a fresh venv with only the
``django`` extra (and psycopg 3, the driver a Django app on PostgreSQL brings itself). No
asyncio database driver may be installed, and the Django example must still stage its
order's event, on SQLite and on PostgreSQL, in the same transaction as the order.

The router's side (``router init-db``, ``router serve``) is the suite's own environment, as
it would be another host's or container's: what is checked here is the application's.

Nothing here is skipped: under CI a missing PostgreSQL fails the test.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import uuid
from pathlib import Path

import asyncpg
import pytest

from tests.conftest import PgDatabases
from tests.e2e.helpers import router
from tests.e2e.test_install import INSTALL_TIMEOUT, copy_clone, run_line, user_env, venv_has

pytestmark = pytest.mark.timeout(600)

ASYNC_DRIVERS = ("asyncpg", "asyncmy", "aiomysql", "psycopg_pool")


@pytest.fixture(scope="module")
def app_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh clone with ``pip install -e '.[django]' 'psycopg[binary]'`` in its venv."""
    folder = tmp_path_factory.mktemp("sync-install")
    copy_clone(folder)
    line = "python3 -m venv .venv && .venv/bin/pip install --quiet -e '.[django]' 'psycopg[binary]'"
    done = run_line(line, folder, timeout=INSTALL_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder


def manage(folder: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``manage.py ARGS`` of the example, with the fresh venv's Python."""
    done = subprocess.run(
        [str(folder / ".venv/bin/python"), "manage.py", *args],
        cwd=folder / "examples" / "django_shop",
        env={**user_env(), **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_the_django_extra_installs_no_asyncio_database_driver(app_venv: Path) -> None:
    found = venv_has(app_venv, "django", "psycopg", "sqlalchemy", *ASYNC_DRIVERS)
    assert found == {
        "django": True,
        "psycopg": True,
        "sqlalchemy": True,
        **dict.fromkeys(ASYNC_DRIVERS, False),
    }


def test_the_django_example_stages_on_sqlite_without_an_async_driver(app_venv: Path) -> None:
    example = app_venv / "examples" / "django_shop"
    shutil.rmtree(example / "var", ignore_errors=True)
    env = {"DATABASE_URL": "sqlite:///./var/shop.db"}
    # The router's host makes its tables; the application's venv only stages.
    created = router("init-db", cwd=example, env=env)
    assert created.returncode == 0, created.stderr
    manage(app_venv, env, "migrate", "--verbosity", "0")
    placed = manage(app_venv, env, "place_order", "--customer", "ada", "--total", "19.90")
    assert "staged order_placed" in placed.stdout

    with sqlite3.connect(example / "var" / "shop.db") as conn:
        orders = conn.execute("SELECT id FROM orders_order").fetchall()
        rows = conn.execute("SELECT event_type, stream_key, envelope FROM router_outbox").fetchall()
    assert len(orders) == 1
    order_id = str(uuid.UUID(orders[0][0]))  # Django keeps a UUID as 32 hex digits on SQLite
    assert [(t, k) for t, k, _ in rows] == [("order_placed", order_id)]
    assert json.loads(rows[0][2])["payload"]["customer"] == "ada"


async def test_the_django_example_stages_on_postgresql_without_an_async_driver(
    app_venv: Path, pg_databases: PgDatabases
) -> None:
    url = await pg_databases.new()  # migrated by the router's own environment
    env = {"DATABASE_URL": url}
    manage(app_venv, env, "migrate", "--verbosity", "0")
    manage(app_venv, env, "check", "--database", "default")
    placed = manage(app_venv, env, "place_order", "--customer", "grace", "--total", "5.00")
    assert "staged order_placed" in placed.stdout

    conn = await asyncpg.connect(url)
    try:
        orders = await conn.fetch("SELECT id FROM orders_order")
        rows = await conn.fetch("SELECT event_type, stream_key, envelope FROM router_outbox")
    finally:
        await conn.close()
    assert len(orders) == 1
    assert [(r["event_type"], r["stream_key"]) for r in rows] == [
        ("order_placed", str(orders[0]["id"]))
    ]
    assert json.loads(rows[0]["envelope"])["payload"]["customer"] == "grace"
