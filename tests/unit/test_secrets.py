"""Secrets never reach logs or printed output."""

from __future__ import annotations

import io
import logging

from router import parse_config
from router._logs import JsonFormatter, TextFormatter
from router._secrets import RedactingFilter, Redactor, secrets_of

CONFIG = """
databases:
  main: postgresql://app:db-Pa55word@db.internal:5432/shop
brokers:
  events:
    type: nats
    internal: true
    url: nats://127.0.0.1:4222,nats://user:nats-s3cret@10.0.0.2:4222
    stream: {name: S, subjects: ["s.>"]}
"""


def test_secrets_are_the_passwords_inside_urls_not_the_whole_url() -> None:
    found = secrets_of(parse_config(CONFIG, env={}))
    assert "db-Pa55word" in found
    assert "nats-s3cret" in found
    assert not any("127.0.0.1" in secret for secret in found)
    redact = Redactor(found)
    assert redact("connecting to nats://127.0.0.1:4222") == "connecting to nats://127.0.0.1:4222"
    assert redact("auth failed for app:db-Pa55word@db") == "auth failed for app:***@db"


def test_connection_strings_lose_their_keys() -> None:
    from pydantic import BaseModel, SecretStr

    class Holder(BaseModel):
        value: SecretStr

    found = secrets_of(
        Holder(
            value=SecretStr(
                "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=send;SharedAccessKey=abcDEF123="
            )
        )
    )
    assert "abcDEF123=" in found
    assert not any("servicebus" in secret for secret in found)
    token = secrets_of(Holder(value=SecretStr("plain-token-value")))
    assert token == ["plain-token-value"]


def capture(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(RedactingFilter(Redactor(["db-Pa55word"])))
    logger = logging.getLogger(f"test.secrets.{id(stream)}")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_log_lines_are_redacted_in_message_arguments_and_extras() -> None:
    for formatter in (TextFormatter(), JsonFormatter()):
        logger, stream = capture(formatter)
        logger.info(
            "db.unavailable %s",
            "password db-Pa55word rejected",
            extra={"error": "FATAL: password db-Pa55word", "database": "main"},
        )
        output = stream.getvalue()
        assert "db-Pa55word" not in output
        assert output.count("***") == 2
        assert "main" in output
