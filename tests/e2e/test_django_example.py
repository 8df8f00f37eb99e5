"""examples/django_shop as a user runs it, on PostgreSQL, MariaDB and SQLite: ``router init-db``,
``manage.py migrate``, ``manage.py check --database default``, ``router serve``, and
``manage.py place_order``; the order's ``OrderPlaced`` must arrive in NATS JetStream. And
``manage.py test``: the shop's own test stages an order's event in Django's test database,
which gets the router's tables with no ``router init-db``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from router.ops.migrate import head_revision
from tests.conftest import NATS_URL, MysqlDatabases, NatsStreams, PgDatabases
from tests.e2e.helpers import ROOT, Serving, router
from tests.services import free_port

HEAD = head_revision()
EXAMPLE = ROOT / "examples" / "django_shop"


def manage(folder: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python manage.py ARGS`` in the example's folder."""
    environ = {**os.environ, **env}
    environ.pop("DJANGO_SETTINGS_MODULE", None)  # manage.py names the example's settings
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=folder,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(params=["postgresql", "mysql", "sqlite"])
async def database_url(
    request: pytest.FixtureRequest, pg_databases: PgDatabases, mysql_databases: MysqlDatabases
) -> str:
    """An empty database: init-db has its tables to create."""
    if request.param == "postgresql":
        return await pg_databases.new(migrated=False)
    if request.param == "mysql":
        return await mysql_databases.new(migrated=False)
    return "sqlite:///./var/shop.db"  # the example's default, in the copy's folder


async def test_an_order_placed_in_django_arrives_in_nats(
    tmp_path: Path, database_url: str, nats_streams: NatsStreams
) -> None:
    folder = tmp_path / "django_shop"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("var", "__pycache__"))
    stream, subject = nats_streams.stream("djshop")
    env = {
        "DATABASE_URL": database_url,
        "NATS_URL": NATS_URL,
        "NATS_STREAM": stream,
        "NATS_SUBJECT": subject,
        "ROUTER_HTTP_BIND": f"127.0.0.1:{free_port()}",
    }

    created = router("init-db", cwd=folder, env=env)
    assert created.returncode == 0, created.stderr
    assert f"upgraded empty -> {HEAD}" in created.stdout
    manage(folder, env, "migrate", "--verbosity", "0")
    checked = manage(folder, env, "check", "--database", "default")
    assert "System check identified no issues" in checked.stdout

    serving = Serving(folder, env)
    try:
        serving.wait_for("router.started")
        placed = manage(folder, env, "place_order", "--customer", "ada", "--total", "19.90")
        messages = await nats_streams.messages(stream, 1)
    finally:
        code = serving.stop()
    assert code == 0, serving.log.read_text()

    # "placed order <id>: staged order_placed <message id>"
    words = placed.stdout.split()
    order_id, message_id = words[2].rstrip(":"), words[-1]
    assert len(messages) == 1, serving.log.read_text()
    message = messages[0]
    assert message.subject == f"{subject}.order_placed"
    assert message.headers["Nats-Msg-Id"] == message_id
    body = json.loads(message.data)
    assert body["type"] == "order_placed"
    assert body["source"] == "django-shop"
    assert body["stream"] == order_id
    assert body["payload"] == {"order_id": order_id, "customer": "ada", "total": "19.90"}


async def test_manage_py_test_stages_in_a_test_database_without_init_db(
    tmp_path: Path, database_url: str
) -> None:
    folder = tmp_path / "django_shop"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("var", "__pycache__"))
    # Django creates test_<name> (SQLite: in memory) and drops it at the end; no init-db ran.
    tested = manage(folder, {"DATABASE_URL": database_url}, "test", "--noinput", "-v", "2")
    assert "One order, and one outbox row for the internal broker, keyed by the order. ... ok" in (
        tested.stderr
    )
    assert "Ran 1 test" in tested.stderr
    assert "\nOK\n" in tested.stderr
