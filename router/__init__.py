"""outbox-router: reliable event publishing from a relational database to message brokers."""

__version__ = "0.1.0"

from router._yaml import load_config, parse_config
from router.config import (
    DatabaseSettings,
    HttpSettings,
    OutboxSettings,
    RetrySettings,
    RouterConfig,
)
from router.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    DatabaseError,
    EnvelopeError,
    MissingDestination,
    PublishError,
    RouterError,
    SchemaError,
    StagingError,
)
from router.events import Event, EventSpec, correlation, current_correlation_id
from router.outbox import Outbox, Transaction
from router.processor import Processor, ProcessorStats
from router.supervisor import Supervisor

__all__ = [
    "BrokerError",
    "BrokerUnavailable",
    "ConfigError",
    "DatabaseError",
    "DatabaseSettings",
    "EnvelopeError",
    "Event",
    "EventSpec",
    "HttpSettings",
    "MissingDestination",
    "Outbox",
    "OutboxSettings",
    "Processor",
    "ProcessorStats",
    "PublishError",
    "RetrySettings",
    "RouterConfig",
    "RouterError",
    "SchemaError",
    "StagingError",
    "Supervisor",
    "Transaction",
    "__version__",
    "correlation",
    "current_correlation_id",
    "load_config",
    "parse_config",
]
