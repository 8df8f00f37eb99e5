"""Importing the library or the CLI loads no broker SDK; a missing client names its extra."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from brokers import MissingClient, create_broker
from brokers.kafka import KafkaSettings
from router import ConfigError, parse_config
from router._yaml import require_clients

SDKS = ("faststream", "aiokafka", "aio_pika", "aiormq", "redis", "azure", "nats")

CONFIG = """
databases:
  main: sqlite:///outbox.db
brokers:
  events:
    type: nats
    internal: true
    stream: {name: EVENTS, subjects: ["shop.>"]}
  analytics:
    type: kafka
    bootstrap_servers: 127.0.0.1:9092
"""


def _loaded_after(code: str, packages: tuple[str, ...] = SDKS) -> list[str]:
    """Which of ``packages`` a fresh interpreter has imported after running ``code``."""
    probe = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({packages!r}))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    loaded: list[str] = json.loads(out)
    return loaded


@pytest.mark.parametrize(
    "code",
    [
        "import router",
        "import router.cli.main",
        "import brokers, brokers.kafka, brokers.redis, brokers.rabbitmq, brokers.servicebus",
        f"import router; router.parse_config({CONFIG!r})",
    ],
)
def test_no_broker_sdk_is_imported(code: str) -> None:
    assert _loaded_after(code) == []


def test_psycopg2_is_imported_only_when_a_store_follows_the_log() -> None:
    """``wakeup: log`` is an extra (postgres-log): the PostgreSQL store, and so `router
    serve` on a database that does not follow the log, never needs psycopg2."""
    code = "import router, router.cli.main, router.relay.store.postgres"
    assert _loaded_after(code, ("psycopg2",)) == []


def test_a_sync_script_on_a_db_api_connection_loads_no_sqlalchemy(tmp_path: Path) -> None:
    """SQLAlchemy is for the SQLAlchemy connections: importing the writer, loading a config
    and choosing the driver of a DB-API connection leave it unimported (its import is a third
    of a second at a script's start)."""
    (tmp_path / "config.yaml").write_text(CONFIG)
    code = (
        "import sqlite3\nfrom router import Event, SyncOutbox\n"
        "from router.write.drivers import sync_driver\n"
        f"SyncOutbox.from_file({str(tmp_path / 'config.yaml')!r})\n"
        "sync_driver(sqlite3.connect(':memory:'))"
    )
    assert _loaded_after(code, ("sqlalchemy", "django")) == []


def test_help_loads_no_broker_sdk() -> None:
    code = (
        "import sys, contextlib, io\nfrom router.cli.main import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])"
    )
    assert _loaded_after(code) == []


def test_a_missing_client_is_named_with_its_yaml_path_and_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(KafkaSettings, "client_modules", ("no_such_kafka_client",))
    config = parse_config(CONFIG)
    with pytest.raises(ConfigError) as caught:
        require_clients(config, "config.yaml")
    assert str(caught.value) == (
        "config.yaml: 1 problem:\n"
        "  - brokers.analytics: the kafka broker needs its client library "
        "(no_such_kafka_client is not installed): pip install 'outbox-router[kafka]'"
    )


def test_a_missing_mysql_driver_is_named_with_its_yaml_path_and_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("router._db.MYSQL_DRIVER", "no_such_mysql_driver")
    config = parse_config(CONFIG.replace("sqlite:///outbox.db", "mariadb://root@db:3306/shop"))
    with pytest.raises(ConfigError) as caught:
        require_clients(config, "config.yaml")
    assert str(caught.value) == (
        "config.yaml: 1 problem:\n"
        "  - databases.main: a MySQL or MariaDB database needs the no_such_mysql_driver driver "
        "(no_such_mysql_driver is not installed): pip install 'outbox-router[mysql]'"
    )


def test_a_missing_postgresql_driver_is_named_with_its_yaml_path_and_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # asyncpg is an extra: an application that stages only from sync code does without it.
    monkeypatch.setattr("router._db.POSTGRES_DRIVER", "no_such_pg_driver")
    config = parse_config(CONFIG.replace("sqlite:///outbox.db", "postgresql://db/shop"))
    with pytest.raises(ConfigError) as caught:
        require_clients(config, "config.yaml")
    assert str(caught.value) == (
        "config.yaml: 1 problem:\n"
        "  - databases.main: a PostgreSQL database needs the no_such_pg_driver driver "
        "(no_such_pg_driver is not installed): pip install 'outbox-router[postgresql]'"
    )


def test_kinds_the_config_does_not_use_are_not_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(KafkaSettings, "client_modules", ("no_such_kafka_client",))
    config = parse_config(CONFIG.split("  analytics:")[0])
    require_clients(config)  # only NATS is used: nothing to report


def test_opening_a_broker_without_its_client_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(KafkaSettings, "adapter", "no_such_kafka_adapter:KafkaBroker")
    settings = parse_config(CONFIG).brokers["analytics"]
    with pytest.raises(MissingClient, match=r"pip install 'outbox-router\[kafka\]'"):
        create_broker("analytics", settings)


def test_a_worker_imports_nothing_of_the_write_path_or_the_other_commands() -> None:
    # What `router serve` imports before its first claim: SQLAlchemy (the write path and
    # the operator commands) and alembic (init-db) would cost it a third of a second.
    code = (
        "import router, router.cli.main, router.serve.runner, router.serve.workers, "
        "router.relay.store.postgres, router.relay.store.sqlite"
    )
    assert _loaded_after(code, ("sqlalchemy", "alembic", "jsonschema")) == []


def test_the_package_exports_every_name_on_first_use() -> None:
    import router

    for name in router.__all__:
        assert getattr(router, name) is not None, name
    assert set(dir(router)) == set(router.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        router.Nope  # noqa: B018


def test_the_help_names_the_contract_lock_file() -> None:
    from router.cli import contract as command
    from router.ops import contract

    assert command.LOCK_FILE == contract.LOCK_FILE
