"""Secrets never reach logs or printed output, and addresses still do."""

from __future__ import annotations

import io
import logging
import uuid

import pytest
from pydantic import BaseModel, SecretStr

from router import parse_config
from router._secrets import RedactingFilter, Redactor, secrets_of
from router.cli.logs import JsonFormatter, TextFormatter

CONFIG = """
databases:
  main: postgresql://app:db-Pa55word@db.internal:5432/shop
brokers:
  events:
    type: nats
    internal: true
    url: nats://127.0.0.1:4222,nats://user:nats-s3cret@10.0.0.2:4222
    stream: {name: S, subjects: ["s.>"]}
  analytics:
    type: kafka
    bootstrap_servers: kafka.internal:9092
    sasl: {username: shop, password: kafka-pw-9}
  billing:
    type: servicebus
    connection_string: "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=send;SharedAccessKey=abcDEF123="
http:
  token: http-bearer-token
"""


class Holder(BaseModel):
    """One secret setting, as a config model holds it."""

    value: SecretStr


def secrets_in(value: str) -> list[str]:
    return secrets_of(Holder(value=SecretStr(value)))


def test_every_secret_of_a_config_is_found() -> None:
    found = secrets_of(parse_config(CONFIG, env={}))
    for secret in ("db-Pa55word", "nats-s3cret", "kafka-pw-9", "abcDEF123=", "http-bearer-token"):
        assert secret in found
    assert found == sorted(found, key=len, reverse=True)


def test_a_url_is_redacted_to_its_password_so_output_still_says_where_it_connects() -> None:
    redact = Redactor(secrets_of(parse_config(CONFIG, env={})))
    assert (
        redact("cannot reach postgresql://app:db-Pa55word@db.internal:5432/shop")
        == "cannot reach postgresql://app:***@db.internal:5432/shop"
    )
    assert redact("nats://127.0.0.1:4222 refused") == "nats://127.0.0.1:4222 refused"
    assert redact("kafka.internal:9092 timed out") == "kafka.internal:9092 timed out"


def test_a_url_without_a_password_is_not_a_secret() -> None:
    assert secrets_in("nats://127.0.0.1:4222") == []
    assert secrets_in("postgresql://app@db.internal/shop") == []


@pytest.mark.parametrize(
    ("url", "secrets"),
    [
        ("postgresql://app:pw-1234@db/shop", {"pw-1234"}),
        ("redis://:only-pass@cache:6379/0", {"only-pass"}),
        ("postgresql://app:p%40ss-word@db/shop", {"p%40ss-word", "p@ss-word"}),
        ("redis://cache:6379/0?password=query-pw&db=1", {"query-pw"}),
        ("nats://a:first-pw@h1:4222, nats://b:second-pw@h2:4222", {"first-pw", "second-pw"}),
    ],
)
def test_passwords_inside_urls_are_found_in_every_spelling(url: str, secrets: set[str]) -> None:
    assert set(secrets_in(url)) == secrets


def test_key_value_connection_strings_lose_their_keys_but_not_their_endpoint() -> None:
    found = secrets_in(
        "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=send;"
        "SharedAccessKey=abcDEF123="
    )
    assert "abcDEF123=" in found
    assert not any("servicebus" in secret for secret in found)
    redact = Redactor(found)
    assert redact("sb://ns.servicebus.windows.net/ said 401") == (
        "sb://ns.servicebus.windows.net/ said 401"
    )
    assert redact("SharedAccessKey=abcDEF123=") == "SharedAccessKey=***"


def test_a_secret_that_is_no_url_is_secret_as_a_whole() -> None:
    assert secrets_in("plain-token-value") == ["plain-token-value"]
    assert secrets_in("abc") == []  # too short to redact without blanking ordinary words


def test_a_url_password_with_semicolon_and_equals_is_still_found() -> None:
    assert "s3cr;t=x" in secrets_in("postgresql://app:s3cr;t=x@db.internal/shop")


def test_the_redactor_replaces_longer_secrets_first() -> None:
    redact = Redactor(["abcd", "abcdefgh"])
    assert redact("token abcdefgh and abcd") == "token *** and ***"
    assert Redactor()("nothing to hide") == "nothing to hide"


def capture(formatter: logging.Formatter, *secrets: str) -> tuple[logging.Logger, io.StringIO]:
    """A real logger whose one handler formats into a buffer, through the redacting filter."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(RedactingFilter(Redactor(secrets)))
    logger = logging.getLogger(f"tests.unit.secrets.{uuid.uuid4().hex}")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, stream


@pytest.mark.parametrize("formatter", [logging.Formatter(), TextFormatter(), JsonFormatter()])
def test_log_lines_are_redacted_in_message_arguments_and_extras(
    formatter: logging.Formatter,
) -> None:
    logger, stream = capture(formatter, "db-Pa55word")
    logger.warning(
        "db-Pa55word in the message, %s in an argument",
        "db-Pa55word",
        extra={"error": "FATAL: password db-Pa55word", "database": "main", "attempts": 3},
    )
    output = stream.getvalue()
    assert "db-Pa55word" not in output
    assert "*** in the message, *** in an argument" in output
    if type(formatter) is not logging.Formatter:  # the stdlib formatter prints no extras
        assert "FATAL: password ***" in output
        assert "main" in output
        assert "3" in output


def test_the_filter_keeps_every_record_and_leaves_clean_ones_alone() -> None:
    logger, stream = capture(TextFormatter(), "db-Pa55word")
    logger.info("first %d", 1)
    logger.info("second", extra={"database": "main"})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("first 1")
    assert lines[1].endswith("second database=main")


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()])
def test_a_logged_exception_is_redacted_too(formatter: logging.Formatter) -> None:
    logger, stream = capture(formatter, "db-Pa55word")
    try:
        raise ConnectionError("cannot connect to postgresql://app:db-Pa55word@db/shop")
    except ConnectionError:
        logger.exception("processor.error")
    output = stream.getvalue()
    assert "ConnectionError" in output
    assert "db-Pa55word" not in output
