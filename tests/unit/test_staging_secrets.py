"""An application that only stages loads its config without the partners' secrets: a
broker's password, URL or connection string (and ``http.token``) is read by ``router serve``
and ``router check``, which still refuse it unset, never by ``Outbox`` or ``SyncOutbox``."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from router import ConfigError, Event, Outbox, SyncOutbox, load_config
from tests.unit.conftest import migrate, table_rows

CONFIG = """
databases:
  main: sqlite:///outbox.db
brokers:
  events:
    type: nats
    internal: true
    url: nats://127.0.0.1:4222
    destination: "shop.{event_type}"
    stream: {name: SHOP, subjects: ["shop.>"]}
  billing:
    type: rabbitmq
    url: amqp://shop:${BILLING_RABBIT_PASSWORD}@127.0.0.1:5672/
    exchange: {name: billing.events, type: topic}
  audit:
    type: servicebus
    connection_string: ${AUDIT_SERVICEBUS_CONNECTION_STRING}
  analytics:
    type: kafka
    sasl: {username: shop, password: "${ANALYTICS_KAFKA_PASSWORD}"}
http:
  token: ${ROUTER_HTTP_TOKEN}
"""
TARGETS = ["analytics", "audit", "billing", "events"]
UNSET = [
    "brokers.billing.url: environment variable BILLING_RABBIT_PASSWORD is not set",
    "brokers.audit.connection_string: environment variable AUDIT_SERVICEBUS_CONNECTION_STRING "
    "is not set",
    "brokers.analytics.sasl.password: environment variable ANALYTICS_KAFKA_PASSWORD is not set",
    "http.token: environment variable ROUTER_HTTP_TOKEN is not set",
]


class InvoiceSent(Event, type="secrets.invoice_sent", published=True):
    """An event every partner receives."""

    invoice_id: str


@pytest.fixture
async def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for line in UNSET:
        monkeypatch.delenv(line.rpartition("variable ")[2].split()[0], raising=False)
    await migrate(tmp_path)
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    return path


async def test_outbox_from_file_stages_without_the_partners_secrets(config_file: Path) -> None:
    outbox = Outbox.from_file(config_file)
    try:
        async with outbox.transaction() as tx:
            await tx.stage(InvoiceSent(invoice_id="i-1"))
    finally:
        await outbox.close()

    assert sorted(row["target"] for row in table_rows(config_file.parent / "outbox.db")) == (
        TARGETS
    )


async def test_sync_outbox_from_file_stages_without_the_partners_secrets(
    config_file: Path,
) -> None:
    outbox = SyncOutbox.from_file(config_file)
    with sqlite3.connect(config_file.parent / "outbox.db") as connection:
        outbox.stage(connection, InvoiceSent(invoice_id="i-2"))

    assert sorted(row["target"] for row in table_rows(config_file.parent / "outbox.db")) == (
        TARGETS
    )


async def test_loading_for_serve_refuses_every_unset_secret_by_its_path(
    config_file: Path,
) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(config_file)

    assert str(error.value) == f"{config_file}: 4 problems:\n" + "\n".join(
        f"  - {line}" for line in UNSET
    )


async def test_a_secret_the_writer_did_not_load_refuses_to_be_read(config_file: Path) -> None:
    settings = SyncOutbox.from_file(config_file).config.brokers["billing"]

    with pytest.raises(ConfigError) as error:
        settings.public_url()

    assert str(error.value) == (
        "brokers.billing.url: environment variable BILLING_RABBIT_PASSWORD is not set (this "
        "config was loaded to stage events, which does not need it)"
    )
