"""config.yaml: interpolation, validation, and errors that name the YAML path but never a
secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from brokers import EventRoute
from brokers.settings import KafkaSettings, NatsSettings
from router import ConfigError, RouterConfig, RouterError, load_config, parse_config
from router._db import sqlite_path

ROOT = Path(__file__).resolve().parents[2]
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

MINIMAL = """
databases: {main: "sqlite:///x.db"}
brokers: {events: {type: memory, internal: true}}
"""


def problems(text: str, env: dict[str, str] | None = None) -> str:
    """The message of the ConfigError that ``text`` raises."""
    with pytest.raises(ConfigError) as caught:
        parse_config(text, env=env or {})
    return str(caught.value)


def changed(old: str, new: str) -> str:
    """VALID with one edit (which must apply)."""
    assert old in VALID
    return VALID.replace(old, new, 1)


def test_a_valid_config_parses_with_defaults_filled_in() -> None:
    config = parse_config(VALID, env={})
    assert config.service == "shop"
    assert config.databases["main"].kind == "sqlite"
    events, partner = config.brokers["events"], config.brokers["partner"]
    assert (events.internal, events.profile) == (True, "internal")
    assert (partner.internal, partner.profile) == (False, "external")
    assert partner.wants("order_placed", published=True)
    assert not partner.wants("order_internal_note", published=True)
    assert not partner.wants("order_placed", published=False)
    assert config.outbox.batch_size == 100
    assert config.outbox.lease_seconds == 30
    assert config.outbox.retry == config.outbox.retry.model_copy(
        update={"max_attempts": 5, "base_delay": 0.5, "max_delay": 10, "jitter": 0.1}
    )
    assert (config.http.host, config.http.port) == ("127.0.0.1", 8642)


def test_the_shipped_config_yaml_loads_without_any_environment() -> None:
    config = load_config(ROOT / "config.yaml", env={})
    assert config.base_dir == ROOT
    assert [name for name, broker in config.brokers.items() if broker.internal] == ["events"]


def test_environment_values_replace_references_and_defaults_fill_the_gaps() -> None:
    config = parse_config(
        VALID, env={"DATABASE_URL": "postgresql://app@db/shop", "PARTNER_PASSWORD": SECRET}
    )
    assert config.databases["main"].kind == "postgresql"
    partner = config.brokers["partner"]
    assert isinstance(partner, NatsSettings)
    assert partner.url.get_secret_value() == f"nats://partner:{SECRET}@10.0.0.7:4222"
    assert SECRET not in repr(config)

    defaults = parse_config(VALID, env={})
    events = defaults.brokers["events"]
    assert isinstance(events, NatsSettings)
    assert events.servers() == ["nats://127.0.0.1:4222"]


def test_a_double_dollar_is_a_literal_dollar() -> None:
    text = MINIMAL.replace("sqlite:///x.db", "sqlite:///price$$list-$${NAME}.db")
    config = parse_config(text, env={"NAME": "unused"})
    assert config.databases["main"].url.get_secret_value() == "sqlite:///price$list-${NAME}.db"


def test_values_from_the_environment_are_not_interpolated_again() -> None:
    text = MINIMAL.replace("sqlite:///x.db", "${DB}")
    config = parse_config(text, env={"DB": "sqlite:///a$$b-${NAME}.db", "NAME": "unused"})
    assert config.databases["main"].url.get_secret_value() == "sqlite:///a$$b-${NAME}.db"


def test_a_whole_value_reference_takes_the_yaml_type_of_its_value() -> None:
    text = MINIMAL + (
        "outbox:\n"
        "  batch_size: ${BATCH:-4222}\n"
        "  retention: {interval: '${EVERY:-3600}'}\n"
        "  retry: {jitter: '${JITTER}'}\n"
        "http: {enabled: '${HTTP:-false}', bind: '127.0.0.1:${PORT:-9000}'}\n"
    )
    config = parse_config(text, env={"JITTER": "0.25"})
    assert config.outbox.batch_size == 4222
    assert config.outbox.retention.interval.total_seconds() == 3600
    assert config.outbox.retry.jitter == 0.25
    assert config.http.enabled is False
    assert config.http.port == 9000  # part of a longer value: interpolated as text


@pytest.mark.parametrize("password", ["20240517", "yes", "0777"])
def test_a_string_setting_takes_any_environment_value_as_text(password: str) -> None:
    text = MINIMAL.replace(
        "brokers: {events: {type: memory, internal: true}}",
        "brokers:\n"
        "  events: {type: memory, internal: true}\n"
        "  analytics:\n"
        "    type: kafka\n"
        "    sasl: {username: shop, password: '${KAFKA_PASSWORD}'}\n",
    )
    analytics = parse_config(text, env={"KAFKA_PASSWORD": password}).brokers["analytics"]
    assert isinstance(analytics, KafkaSettings)
    assert analytics.sasl is not None
    assert analytics.sasl.password.get_secret_value() == password


def test_a_missing_variable_names_its_yaml_path() -> None:
    message = problems(changed("${PARTNER_PASSWORD:-none}", "${PARTNER_PASSWORD}"))
    assert "brokers.partner.url: environment variable PARTNER_PASSWORD is not set" in message


def test_every_missing_variable_is_reported_at_once_with_list_positions() -> None:
    text = changed('subjects: ["shop.>"]', 'subjects: ["shop.>", "${EXTRA}"]').replace(
        "service: shop", "service: ${SERVICE}"
    )
    message = problems(text)
    assert message.startswith("config.yaml: 2 problems:")
    assert "  - service: environment variable SERVICE is not set" in message
    assert "  - brokers.events.stream.subjects[1]: environment variable EXTRA is not set" in message


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("name: SHOP", "name: 'S H'", "brokers.events.stream.name: String should match pattern"),
        ("internal: true", "internal: true\n    colour: red", "brokers.events.colour: unknown key"),
        ("batch_size: 100", "batch_size: 100\n  batch: 1", "outbox.batch: unknown key"),
        ("service: shop", "service: shop\nservise: shop", "servise: unknown key"),
        (
            "type: nats\n    internal",
            "type: kafak\n    internal",
            "brokers.events: unknown type 'kafak'; expected one of",
        ),
        (
            "    type: nats\n    internal: true\n",
            "    internal: true\n",
            "brokers.events: 'type' is missing (which kind of broker is this?)",
        ),
        (
            "shop.{event_type}",
            "shop.{evt}",
            "brokers.events.destination: unknown placeholder(s) ['evt']; use {destination}, "
            "{event_type}, {service}, {version}",
        ),
        (
            "shop.{event_type}",
            "shop.{event_type",
            "brokers.events.destination: invalid template",
        ),
        (
            'subjects: ["shop.>"]',
            'subjects: ["shop.>.x"]',
            "brokers.events.stream.subjects: 'shop.>.x': '>' must be the last token",
        ),
        (
            'subjects: ["shop.>"]',
            'subjects: ["shop.ord*"]',
            "brokers.events.stream.subjects: 'shop.ord*': wildcards must be whole tokens",
        ),
        (
            'subjects: ["shop.>"]',
            'subjects: ["shop..x"]',
            "brokers.events.stream.subjects: 'shop..x' is not a valid NATS subject",
        ),
        (
            "max_delay: 10",
            "max_delay: 0.1",
            "outbox.retry: max_delay must be at least base_delay",
        ),
        ("batch_size: 100", "batch_size: 0", "outbox.batch_size: Input should be greater"),
        (
            "batch_size: 100",
            "batch_size: 100\n  linger: 0.5",
            "outbox.linger: Input should be less than or equal to 0.1",
        ),
        ("service: shop", "service: shop\nhttp: {bind: nowhere}", "http.bind: must be host:port"),
        ("service: shop", "service: shop\nhttp: {bind: 'h:99999'}", "http.bind: must be host:port"),
        (
            "main: ${DATABASE_URL:-sqlite:///./var/shop.db}",
            "main: {url: 'sqlite:///x.db', brokers: [events, nope]}",
            "databases.main.brokers: unknown broker(s) ['nope']",
        ),
        (
            "main: ${DATABASE_URL:-sqlite:///./var/shop.db}",
            "main: {url: 'sqlite:///x.db', brokers: [7]}",
            "databases.main.brokers[0]: Input should be a valid string",
        ),
        (
            "main: ${DATABASE_URL:-sqlite:///./var/shop.db}",
            "main: oracle://x/y",
            "databases.main.url: only postgresql://, mysql:// (or mariadb://) and sqlite:/// "
            "databases are supported",
        ),
        (
            "main: ${DATABASE_URL:-sqlite:///./var/shop.db}",
            "main: 'postgresql://app@db1:5432,db2:x/shop'",
            "databases.main.url: host 2 of the URL is not host[:port]",
        ),
        (
            "main: ${DATABASE_URL:-sqlite:///./var/shop.db}",
            "main: 'mysql://root@db1,db2/shop'",
            "databases.main.url: several hosts in one URL are supported on PostgreSQL only",
        ),
        (
            "main: ${DATABASE_URL:-sqlite:///./var/shop.db}",
            "main: 'postgresql://db1,db2/shop?target_session_attrs=standby'",
            "databases.main.url: target_session_attrs=standby cannot work",
        ),
        (
            "internal: true",
            "internal: true\n    events: {include: ['*']}",
            "brokers.events: 'events' filters external brokers; the internal broker gets all",
        ),
        (
            "  partner:",
            "  2nd:\n    type: memory\n  partner:",
            "brokers: name '2nd' must start with a letter",
        ),
    ],
)
def test_each_problem_names_its_yaml_path(old: str, new: str, expected: str) -> None:
    assert expected in problems(changed(old, new))


ATOMIC = """
databases: {main: "postgresql://app@db/shop"}
brokers:
  events: {type: memory, internal: true}
  partner:
    type: %s
    atomic: true
    destination: "partner.{event_type}"
    %s
"""
KIND_SETTINGS = {
    "rabbitmq": "exchange: {name: partner}",
    "kafka": "",
    "redis": "",
    "nats": "stream: {name: P, subjects: ['partner.>']}",
}


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("rabbitmq", "RabbitMQ confirms each message on its own"),
        ("kafka", "an atomic write on Kafka is a producer transaction"),
    ],
)
def test_atomic_is_refused_on_a_broker_without_an_atomic_write(kind: str, why: str) -> None:
    message = problems(ATOMIC % (kind, KIND_SETTINGS[kind]))
    assert f"brokers.partner: atomic: true is not possible on {kind}: {why}" in message


@pytest.mark.parametrize("kind", ["redis", "nats"])
def test_atomic_is_taken_on_a_broker_with_an_atomic_write(kind: str) -> None:
    config = parse_config(ATOMIC % (kind, KIND_SETTINGS[kind]), env={})
    assert config.brokers["partner"].atomic


def test_a_redis_duplicate_window_under_a_second_is_refused_naming_the_key() -> None:
    text = ATOMIC % ("redis", "duplicate_window_seconds: 0.5")
    message = problems(text)
    assert "brokers.partner.duplicate_window_seconds" in message
    assert "0.5 s is too short: a unit sent again after a lost answer" in message
    window = parse_config(ATOMIC % ("redis", ""), env={}).brokers["partner"]
    assert window.model_dump()["duplicate_window_seconds"] == 120


@pytest.mark.parametrize("url", ["sqlite:///x.db", "mysql://root@db/shop"])
def test_atomic_is_taken_on_every_database(url: str) -> None:
    """MySQL/MariaDB and SQLite record each row's transaction too (migration 0019)."""
    text = (ATOMIC % ("redis", "")).replace("postgresql://app@db/shop", url)
    assert parse_config(text, env={}).brokers_of("main")["partner"].atomic


def test_two_internal_brokers_are_refused() -> None:
    text = changed('events: {include: ["order_*"], exclude: ["order_internal*"]}', "internal: true")
    assert "only one broker may be internal; found ['events', 'partner']" in problems(text)


def test_two_internal_brokers_are_reported_under_brokers() -> None:
    text = changed('events: {include: ["order_*"], exclude: ["order_internal*"]}', "internal: true")
    [line] = [line for line in problems(text).splitlines() if "internal" in line]
    assert line.removeprefix("  - ").startswith("brokers")


def test_a_lease_shorter_than_a_brokers_longest_publish_is_accepted() -> None:
    # The processor extends a batch's lease while it is still being published
    # (router/relay/lease.py), so the lease need not outlast the longest publish, here
    # 5 s to connect + 10 s for the acks + 1 s; it must only be positive.
    short = changed("  batch_size: 100\n", "  batch_size: 100\n  lease_seconds: 1\n")
    config = parse_config(short, env={})
    assert config.outbox.lease_seconds == 1
    assert config.brokers["events"].publish_limit == 16
    message = problems(short.replace("lease_seconds: 1", "lease_seconds: 0"))
    assert "outbox.lease_seconds: Input should be greater than 0" in message


def test_a_broker_destination_outside_its_stream_is_refused_with_the_stream_named() -> None:
    events = parse_config(VALID, env={}).brokers["events"]
    assert events.destination_for(EventRoute("order_placed", 1, "shop")) == "shop.order_placed"
    outside = parse_config(changed('subjects: ["shop.>"]', 'subjects: ["shop.orders.*"]'), env={})
    with pytest.raises(ValueError, match="'shop.order_placed' is not captured by stream 'SHOP'"):
        outside.brokers["events"].destination_for(EventRoute("order_placed", 1, "shop"))


def test_several_problems_are_reported_together() -> None:
    text = changed("name: SHOP", "name: ''").replace("batch_size: 100", "batch_size: -1")
    message = problems(text)
    assert message.startswith("config.yaml: 2 problems:\n")
    assert "  - brokers.events.stream.name:" in message
    assert "  - outbox.batch_size:" in message


def test_two_brokers_of_one_name_are_refused_with_both_lines() -> None:
    text = VALID.replace("outbox:", "  events:\n    type: memory\noutbox:")
    assert problems(text) == (
        "config.yaml: 1 problem:\n  - brokers.events: key given twice (lines 6 and 18)"
    )


def test_a_nested_setting_given_twice_is_refused_without_its_values() -> None:
    text = changed("batch_size: 100\n", "batch_size: 100\n  retry: {jitter: 0.1}\n") + (
        f"  batch_size: {SECRET}\n"
    )
    assert problems(text) == (
        "config.yaml: 2 problems:\n"
        "  - outbox.retry: key given twice (lines 20 and 21)\n"
        "  - outbox.batch_size: key given twice (lines 19 and 22)"
    )


def test_a_mapping_may_override_what_it_merges() -> None:
    text = MINIMAL.replace(
        "brokers: {events: {type: memory, internal: true}}",
        "brokers:\n"
        "  events: &memory {type: memory, internal: true, publish_timeout: 3}\n"
        "  partner: {<<: *memory, internal: false}\n",
    )
    config = parse_config(text, env={})
    assert config.brokers["partner"].publish_timeout == 3
    assert not config.brokers["partner"].internal


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # a secret next to the mistake
        ("url: ${NATS_URL:-nats://127.0.0.1:4222}", f"url: nats://u:{SECRET}@h:4222\n    pw: 1"),
        # a secret that is itself the mistake
        ("main: ${DATABASE_URL:-sqlite:///./var/shop.db}", f"main: oracle://app:{SECRET}@db/x"),
        (
            "main: ${DATABASE_URL:-sqlite:///./var/shop.db}",
            f"main: 'postgresql://a:{SECRET}@h:1,h:x/d'",
        ),
        # a password with an unescaped '/' reads as the end of the host list
        (
            "main: ${DATABASE_URL:-sqlite:///./var/shop.db}",
            f"main: 'postgresql://a,b:{SECRET}/x@h/d'",
        ),
        ("url: ${NATS_URL:-nats://127.0.0.1:4222}", f"url: [{SECRET}]"),
        ("batch_size: 100", f"batch_size: {SECRET}"),
        ("service: shop", f"service: shop\nhttp: {{bind: '{SECRET}', token: [{SECRET}]}}"),
        ("name: SHOP", f"name: {SECRET}!"),
        ("jitter: 0.1", f"jitter: {SECRET}"),
    ],
)
def test_errors_never_repeat_a_secret(old: str, new: str) -> None:
    message = problems(changed(old, new))
    assert "config.yaml: 1 problem" in message or "config.yaml: 2 problems" in message
    assert SECRET not in message


def test_errors_never_repeat_a_secret_taken_from_the_environment() -> None:
    text = changed("batch_size: 100", "batch_size: ${PARTNER_PASSWORD}").replace(
        "main: ${DATABASE_URL:-sqlite:///./var/shop.db}", "main: ${DATABASE_URL}"
    )
    message = problems(
        text, env={"PARTNER_PASSWORD": SECRET, "DATABASE_URL": f"oracle://app:{SECRET}@db/x"}
    )
    assert "outbox.batch_size:" in message
    assert "databases.main.url:" in message
    assert SECRET not in message


def test_config_errors_are_router_errors() -> None:
    with pytest.raises(RouterError):
        parse_config("databases: {}\n", env={})


def test_load_config_reports_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="config file not found") as caught:
        load_config(missing)
    assert str(missing) in str(caught.value)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("databases:\n  main: [unclosed\n", "line 3, column 1"),
        ("service: shop\nbrokers:\n  events: {type: memory\n  x: 1\n", "line 4, column 4"),
        ("service: shop\n\tdatabases: {}\n", "line 2, column 1"),
    ],
)
def test_load_config_reports_where_the_yaml_is_broken(
    tmp_path: Path, text: str, where: str
) -> None:
    broken = tmp_path / "config.yaml"
    broken.write_text(text)
    with pytest.raises(ConfigError, match=f"config.yaml: invalid YAML at {where}: "):
        load_config(broken)


def test_load_config_wants_a_mapping_at_the_top(tmp_path: Path) -> None:
    listed = tmp_path / "config.yaml"
    listed.write_text("- just a list\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(listed)


def test_relative_sqlite_paths_start_at_the_config_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "config.yaml").write_text(VALID)
    monkeypatch.chdir(tmp_path)  # not the config's folder

    config = load_config(Path("app") / "config.yaml", env={})

    assert config.base_dir == folder.resolve()
    main = config.databases["main"]
    assert sqlite_path(main, config.base_dir) == folder.resolve() / "var" / "shop.db"
    assert config.resolve_path("data/x") == folder.resolve() / "data" / "x"


def test_parsed_text_anchors_relative_paths_at_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = parse_config(VALID, env={})
    assert sqlite_path(config.databases["main"], config.base_dir) == tmp_path / "var" / "shop.db"


def test_absolute_sqlite_paths_stay_where_they_are(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(VALID)
    config: RouterConfig = load_config(
        tmp_path / "config.yaml", env={"DATABASE_URL": "sqlite:////srv/data/shop.db"}
    )
    assert sqlite_path(config.databases["main"], config.base_dir) == Path("/srv/data/shop.db")


MULTI_HOST = f"postgresql://app:{SECRET}@db1:5432,[::1],db3:6432/shop"


def test_a_multi_host_postgresql_url_connects_to_the_host_that_accepts_writes() -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    from router._db import asyncpg_dsn, sqlalchemy_url
    from router.config import DatabaseSettings

    database = DatabaseSettings.model_validate({"url": MULTI_HOST})
    assert database.hosts() == [("db1", 5432), ("::1", 5432), ("db3", 6432)]
    assert asyncpg_dsn(database) == f"{MULTI_HOST}?target_session_attrs=read-write"
    # What SQLAlchemy's asyncpg dialect hands asyncpg.connect() for an application's engine.
    engine = create_async_engine(sqlalchemy_url(database, ROOT))  # connects to nothing yet
    _, args = engine.dialect.create_connect_args(engine.url)
    assert args == {
        "user": "app",
        "password": SECRET,
        "database": "shop",
        "host": ["db1", "::1", "db3"],
        "port": [5432, 5432, 6432],
        "target_session_attrs": "read-write",
    }
    assert database.public_url() == "postgresql://***@db1:5432,[::1],db3:6432/shop"


def test_a_url_that_chose_its_session_attributes_keeps_them() -> None:
    from router._db import asyncpg_dsn
    from router.config import DatabaseSettings

    url = "postgresql://app@db1,db2/shop?target_session_attrs=primary"
    assert asyncpg_dsn(DatabaseSettings.model_validate({"url": url})) == url
    single = "postgresql://app@db1/shop"  # one host: asyncpg's default, as before
    assert asyncpg_dsn(DatabaseSettings.model_validate({"url": single})) == single
