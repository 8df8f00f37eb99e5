"""The one error tree of outbox-router.

It lives in the lowest package so that ``envelopes``, ``brokers`` and ``router`` can all
raise from it while imports keep flowing one way (``envelopes`` <- ``brokers`` <- ``router``).
``router.errors`` re-exports it: the public error module, the place users import from.

    RouterError
    ├── ConfigError            invalid config.yaml (names the YAML path and the problem)
    ├── BrokerError
    │   ├── BrokerUnavailable  cannot reach or talk to the broker (always retryable)
    │   │   └── MissingDestination  a stream/exchange the config names does not exist, and
    │   │                      the broker's settings do not create it
    │   └── PublishError       the broker refused or failed one message (``retryable`` says
    │                          whether trying again can help)
    ├── EnvelopeError          an envelope cannot be built, parsed or rendered
    ├── StagingError           an event was rejected inside the caller's transaction
    ├── DowncastError          an event cannot be downcast to the version a partner is
    │                          pinned to (its row retries)
    └── DatabaseError          the database cannot be reached, or a statement failed
        └── SchemaError        the router's tables are missing or older than this router
                               (run ``router init-db``)
"""

from __future__ import annotations

__all__ = [
    "BrokerError",
    "BrokerUnavailable",
    "ConfigError",
    "DatabaseError",
    "DowncastError",
    "EnvelopeError",
    "MissingDestination",
    "PublishError",
    "RouterError",
    "SchemaError",
    "StagingError",
]


class RouterError(Exception):
    """Base of every error outbox-router raises on purpose."""


class ConfigError(RouterError):
    """The configuration is invalid; the message names each YAML path and what is wrong."""


class BrokerError(RouterError):
    """A broker operation failed."""


class BrokerUnavailable(BrokerError):
    """The broker cannot be reached, or the connection broke; retry later."""


class MissingDestination(BrokerUnavailable):
    """A stream, exchange or queue the config names does not exist, and is not created here.

    A ``BrokerUnavailable``: the target's circuit opens instead of rows spending attempts.
    """


class PublishError(BrokerError):
    """The broker did not accept one message."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class EnvelopeError(RouterError):
    """An envelope cannot be built, parsed or rendered."""


class StagingError(RouterError):
    """An event was rejected by ``stage()``; nothing was written."""


class DowncastError(RouterError):
    """An event cannot be downcast to the version a partner is pinned to: its downcaster
    raised, or this process declares no class of the stored version. The partner's row fails
    and retries; the message is the cause's."""


class DatabaseError(RouterError):
    """The database cannot be reached, or the outbox table is not there."""


class SchemaError(DatabaseError):
    """The router's tables are missing, or at an older migration than this router needs."""
