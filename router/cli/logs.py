"""Logging for the CLI only (library code just logs): text or JSON lines, secrets redacted."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from types import TracebackType
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
    """Send every log record to stderr in ``fmt`` ('text' or 'json') at ``level``, redacted.

    One handler, on the root logger: the router's records, the client libraries' (which
    propagate to it), Python warnings and an uncaught exception all come out in one format.
    Calling it again (once the config, and with it the secrets, is known) replaces the handler.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RedactingFilter(redactor or Redactor()))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Driver chatter (a line per connection attempt) is rarely useful at info.
    chatty = logging.DEBUG if root.level <= logging.DEBUG else max(logging.WARNING, root.level)
    for name in _LIBRARIES:
        _route_to_root(name, chatty)
    # asyncpg's pool logs a warning with a traceback every time it fails to reconnect its idle
    # connection: one per retry for as long as a database is down. The router's own
    # db.unavailable says so once, with the reason.
    _route_to_root("asyncpg.pool", chatty if chatty == logging.DEBUG else logging.ERROR)
    # Every SQL statement, every row (payloads included), every SQLite call: never wanted here.
    for name in ("sqlalchemy", "aiosqlite"):
        _route_to_root(name, max(logging.WARNING, root.level))
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught


# The client libraries the router may load (most of them lazily, after this setup).
_LIBRARIES = (
    "aio_pika",
    "aiormq",
    "aiokafka",
    "faststream",
    "redis",
    "nats",
    "azure",
    "asyncio",
    "asyncpg",
    "alembic",
    "uvicorn",
    "opentelemetry",
)


class _LibraryLogger(logging.Logger):
    """A client library's logger made before the library is imported: the CLI's settings hold.

    FastStream, when imported, gives its logger a handler of its own (coloured text on stderr,
    unredacted) and stops it propagating; and brokers are imported lazily, after the setup.
    This logger ignores both, and level changes, so its records reach the root's handler.
    """

    @property
    def propagate(self) -> bool:
        """Always: the root's handler writes every record."""
        return True

    @propagate.setter
    def propagate(self, value: bool) -> None:
        pass

    def addHandler(self, hdlr: logging.Handler) -> None:  # noqa: N802 - the stdlib's name
        """Ignored: the root's handler writes every record."""

    def setLevel(self, level: int | str) -> None:  # noqa: N802 - the stdlib's name
        """Ignored: ``setup_logging`` sets it."""


def _route_to_root(name: str, level: int) -> None:
    """Make ``name``'s records (and its children's) go to the root's handler at ``level``."""
    manager = logging.getLogger().manager
    if not isinstance(manager.loggerDict.get(name), logging.Logger):
        previous = logging.getLoggerClass()
        logging.setLoggerClass(_LibraryLogger)
        try:
            logging.getLogger(name)
        finally:
            logging.setLoggerClass(previous)
    for logger_name, logger in list(manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (
            logger_name == name or logger_name.startswith(f"{name}.")
        ):
            for own in list(logger.handlers):
                if not isinstance(own, logging.NullHandler):
                    logger.removeHandler(own)
            logger.propagate = True
    logging.Logger.setLevel(logging.getLogger(name), level)


def _log_uncaught(
    kind: type[BaseException], value: BaseException, traceback: TracebackType | None
) -> None:
    """A crash's traceback as one record, in the log format and redacted."""
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, traceback)
        return
    logging.getLogger("router").critical("router.crashed", exc_info=(kind, value, traceback))


def redact_handlers(redactor: Redactor) -> None:
    """Teach the installed handlers about the secrets of a config loaded after setup."""
    for handler in logging.getLogger().handlers:
        for existing in handler.filters:
            if isinstance(existing, RedactingFilter):
                existing.redactor = redactor
