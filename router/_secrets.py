"""Keep secrets out of everything the router prints: logs, errors, status output.

Values are never put into messages on purpose; this is the second line of defence for text
that comes from drivers and brokers, which may quote a URL back. Every ``SecretStr`` in the
config, and the password inside each URL, is replaced by ``***``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, SecretStr

from brokers import UnsetSecret

__all__ = ["RedactingFilter", "Redactor", "secrets_of"]

_MIN_SECRET = 4  # shorter strings would blank out ordinary words


def secrets_of(model: BaseModel) -> list[str]:
    """Every secret value in a config model, longest first."""
    found: set[str] = set()
    _collect(model, found)
    return sorted((s for s in found if len(s) >= _MIN_SECRET), key=len, reverse=True)


def _collect(value: Any, found: set[str]) -> None:
    if isinstance(value, UnsetSecret):  # no value: nothing to hide
        return
    if isinstance(value, SecretStr):
        found.update(_secret_parts(value.get_secret_value()))
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            _collect(getattr(value, name), found)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found)


def _secret_parts(secret: str) -> set[str]:
    """The parts of a secret setting that must not be shown.

    A URL is shown without its password, and a ``Key=Value;...`` connection string without
    its keys, so that output still says *where* it connects; anything else is secret whole.
    """
    if _URL.match(secret):
        parts: set[str] = set()
        for url in secret.split(","):
            parts.update(_url_secrets(url.strip()))
            parts.update(_query_secrets(url.partition("?")[2]))
        return parts
    if ";" in secret and "=" in secret:
        return _query_secrets(secret.replace(";", "&"))
    return {secret}


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_SECRET_KEYS = ("key", "password", "secret", "token", "signature", "sig", "pwd")


def _query_secrets(query: str) -> set[str]:
    found = set()
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        lowered = name.strip().lower()
        # SharedAccessKeyName=send names a key; it is not one.
        if value and not lowered.endswith("name") and any(w in lowered for w in _SECRET_KEYS):
            found.update({value, unquote(value)})
    return found


def _url_secrets(url: str) -> Iterable[str]:
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return []
    if not password:
        return []
    return [password, unquote(password)]


class Redactor:
    """Replaces known secrets in text."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.secrets = sorted(set(secrets), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, "***")
        return text


_formatter = logging.Formatter()


class RedactingFilter(logging.Filter):
    """A logging filter that redacts the message, its arguments and string extras."""

    _STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message"}

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact in place; never drops a record."""
        if not self.redactor.secrets:
            return True
        record.msg = self.redactor(record.getMessage())
        record.args = None
        if record.exc_info:
            # A driver's exception may quote a URL with its password: render it now, redacted.
            text = _formatter.formatException(record.exc_info)
            record.exc_text = self.redactor(text)
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = self.redactor(record.exc_text)
        for key, value in list(record.__dict__.items()):
            if key not in self._STANDARD and isinstance(value, str):
                setattr(record, key, self.redactor(value))
        return True
