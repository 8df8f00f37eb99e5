"""The error tree (defined in ``envelopes.errors`` so every package can raise from it).

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
