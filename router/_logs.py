"""Logging for the CLI only (library code just logs): text or JSON lines, secrets redacted."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from router._secrets import RedactingFilter, Redactor

__all__ = ["setup_logging"]

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class TextFormatter(logging.Formatter):
    """``time level logger event key=value ...``"""

    def format(self, record: logging.LogRecord) -> str:
        """One line per record, extras as key=value."""
        stamp = datetime.fromtimestamp(record.created, UTC).strftime("%H:%M:%S.%f")[:-3]
        extras = " ".join(f"{k}={_text(v)}" for k, v in _extras(record).items())
        line = f"{stamp} {record.levelname:<7} {record.getMessage()}"
        if extras:
            line += f" {extras}"
        exception = record.exc_text or (
            self.formatException(record.exc_info) if record.exc_info else None
        )
        if exception:
            line += "\n" + exception
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event, then the extras."""

    def format(self, record: logging.LogRecord) -> str:
        """Serialise a record with its structured extras."""
        document: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
            **_extras(record),
        }
        exception = record.exc_text or (
            self.formatException(record.exc_info) if record.exc_info else None
        )
        if exception:
            document["exception"] = exception
        return json.dumps(document, default=str)


def _text(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


def setup_logging(level: str = "info", fmt: str = "text", redactor: Redactor | None = None) -> None:
    """Send router logs to stderr in ``fmt`` ('text' or 'json') at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RedactingFilter(redactor or Redactor()))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Driver chatter is rarely useful at info; keep it for --log-level debug.
    for noisy in ("faststream", "nats", "aiosqlite", "asyncio", "alembic"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def redact_handlers(redactor: Redactor) -> None:
    """Teach the installed handlers about the secrets of a config loaded after setup."""
    for handler in logging.getLogger().handlers:
        for existing in handler.filters:
            if isinstance(existing, RedactingFilter):
                existing.redactor = redactor
