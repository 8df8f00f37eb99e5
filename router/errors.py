"""The public error module: every error and warning outbox-router raises, to catch by
kind. Import them from here or from ``router``, which serves them from here. The exceptions
are defined in ``envelopes.errors``, the lowest package, so that ``brokers`` and
``envelopes`` raise the same classes while imports flow one way; the warning, which only
``router`` raises, is defined here.

RouterError
├── ConfigError
├── BrokerError
│   ├── BrokerUnavailable
│   │   └── MissingDestination
│   └── PublishError (retryable)
├── EnvelopeError
├── StagingError
├── DowncastError
└── DatabaseError
    └── SchemaError

and one warning: ``ConfigDeprecationWarning``, for a config form a later release refuses.
"""

from envelopes.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    DatabaseError,
    DowncastError,
    EnvelopeError,
    MissingDestination,
    PublishError,
    RouterError,
    SchemaError,
    StagingError,
)

__all__ = [
    "BrokerError",
    "BrokerUnavailable",
    "ConfigDeprecationWarning",
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


class ConfigDeprecationWarning(FutureWarning):
    """config.yaml uses a form a later release refuses; the message names the YAML path and
    what to write instead.

    A ``FutureWarning``, which Python shows by default: it speaks to whoever writes the
    config, not to the code's developers (a ``DeprecationWarning`` is hidden outside
    ``__main__``). ``router`` commands log it as ``config.deprecated``.
    """
