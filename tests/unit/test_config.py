"""config.yaml: interpolation, validation, and errors that name the path but never a secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from router import ConfigError, load_config, parse_config
from router._db import sqlite_path

SECRET = "hunter2-XYZ"

VALID = """
service: shop
databases:
  main: ${DATABASE_URL:-sqlite:///./var/shop.db}
brokers:
  events:
    type: nats
    internal: true
    url: ${NATS_URL:-nats://127.0.0.1:4222}
    destination: "shop.{event_type}"
    stream: {name: SHOP, subjects: ["shop.>"]}
  partner:
    type: nats
    url: nats://partner:${PARTNER_PASSWORD:-none}@10.0.0.7:4222
    events: {include: ["order_*"], exclude: ["order_internal*"]}
    destination: "partner.{event_type}"
    stream: {name: PARTNER, subjects: ["partner.>"]}
outbox:
  batch_size: 100
  retry: {max_attempts: 5, base_delay: 0.5, max_delay: 10, jitter: 0.1}
"""


def problems(text: str, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, env=env or {})
    return str(caught.value)


def test_a_valid_config_parses_with_defaults_filled_in() -> None:
    config = parse_config(VALID, env={})
    assert config.service == "shop"
    assert config.databases["main"].kind == "sqlite"
    events = config.brokers["events"]
    assert events.internal
    assert events.profile == "internal"
    assert config.brokers["partner"].profile == "external"
    assert config.outbox.batch_size == 100
    assert config.outbox.lease_seconds == 30
    assert config.outbox.retry.max_attempts == 5
    assert config.http.bind == "127.0.0.1:8642"


def test_environment_values_and_defaults_are_interpolated() -> None:
    config = parse_config(
        VALID, env={"DATABASE_URL": "postgresql://app@db/shop", "PARTNER_PASSWORD": SECRET}
    )
    assert config.databases["main"].kind == "postgresql"
    assert SECRET in config.brokers["partner"].url.get_secret_value()  # type: ignore[union-attr]
    assert SECRET not in repr(config)


def test_a_whole_value_reference_keeps_its_yaml_type_and_dollar_dollar_escapes() -> None:
    text = VALID.replace("batch_size: 100", "batch_size: ${BATCH:-250}").replace(
        "service: shop", "service: shop$$x"
    )
    with pytest.raises(ConfigError, match=r"service: String should match pattern"):
        parse_config(text, env={})
    config = parse_config(text.replace("shop$$x", "shop"), env={"BATCH": "42"})
    assert config.outbox.batch_size == 42


def test_a_missing_variable_names_the_yaml_path() -> None:
    text = VALID.replace("${PARTNER_PASSWORD:-none}", "${PARTNER_PASSWORD}")
    assert "brokers.partner.url: environment variable PARTNER_PASSWORD is not set" in problems(text)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("name: SHOP", "name: 'S H'"), "brokers.events.stream.name: String should match"),
        (
            ("internal: true", "internal: true\n    colour: red"),
            "brokers.events.colour: unknown key",
        ),
        (
            ("type: nats\n    internal", "type: kafak\n    internal"),
            "brokers.events: unknown type 'kafak'; expected one of",
        ),
        (("shop.{event_type}", "shop.{evt}"), "brokers.events.destination: unknown placeholder"),
        (
            ('subjects: ["shop.>"]', 'subjects: ["shop.>.x"]'),
            "brokers.events.stream.subjects: 'shop.>.x': '>' must be the last token",
        ),
        (
            ("max_delay: 10", "max_delay: 0.1"),
            "outbox.retry: max_delay must be at least base_delay",
        ),
        (("batch_size: 100", "batch_size: 0"), "outbox.batch_size: Input should be greater"),
        (("service: shop", "service: shop\nhttp: {bind: nowhere}"), "http.bind: must be host:port"),
        (
            ('events: {include: ["order_*"], exclude: ["order_internal*"]}', "internal: true"),
            "only one broker may be internal; found ['events', 'partner']",
        ),
        (
            ("main: ${DATABASE_URL:-sqlite:///./var/shop.db}", "main: mysql://x/y"),
            "databases.main.url: only postgresql:// and sqlite:/// databases are supported",
        ),
    ],
)
def test_each_problem_names_its_yaml_path(change: tuple[str, str], expected: str) -> None:
    old, new = change
    assert old in VALID
    assert expected in problems(VALID.replace(old, new, 1))


def test_a_broker_without_type_says_so() -> None:
    text = VALID.replace("    type: nats\n    internal: true\n", "    internal: true\n")
    assert "brokers.events: 'type' is missing" in problems(text)


def test_a_database_naming_an_unknown_broker_is_rejected() -> None:
    text = VALID.replace(
        "main: ${DATABASE_URL:-sqlite:///./var/shop.db}",
        "main: {url: 'sqlite:///x.db', brokers: [events, nope]}",
    )
    assert "databases.main.brokers: unknown broker(s) ['nope']" in problems(text)


def test_external_filters_on_the_internal_broker_are_rejected() -> None:
    text = VALID.replace("internal: true", "internal: true\n    events: {include: ['*']}")
    assert "the internal broker gets all" in problems(text)


def test_errors_never_repeat_secret_values() -> None:
    text = VALID.replace("${PARTNER_PASSWORD:-none}", SECRET).replace(
        "url: ${NATS_URL:-nats://127.0.0.1:4222}", f"url: 12345\n    password: {SECRET}"
    )
    message = problems(text)
    assert "brokers.events.password: unknown key" in message
    assert SECRET not in message


def test_several_problems_are_reported_together() -> None:
    text = VALID.replace("name: SHOP", "name: ''").replace("batch_size: 100", "batch_size: -1")
    message = problems(text)
    assert message.startswith("config.yaml: 2 problems:")


def test_load_config_reports_a_missing_file_and_broken_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "config.yaml"
    broken.write_text("databases:\n  main: [unclosed\n")
    with pytest.raises(ConfigError, match=r"config.yaml: invalid YAML at line 3, column 1"):
        load_config(broken)
    broken.write_text("- just a list\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(broken)


def test_relative_sqlite_paths_start_at_the_config_folder(tmp_path: Path) -> None:
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "config.yaml").write_text(VALID)
    config = load_config(folder / "config.yaml", env={})
    assert config.base_dir == folder.resolve()
    assert sqlite_path(config.databases["main"], config.base_dir) == folder / "var" / "shop.db"
