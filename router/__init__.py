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
from router.ops.supervisor import Supervisor
from router.relay.processor import Processor, ProcessorStats
from router.write.events import Event, EventSpec, correlation, current_correlation_id
from router.write.inbox import Inbox, inbox_middleware, message_id_of
from router.write.outbox import Outbox, Transaction

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
    "Inbox",
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
    "inbox_middleware",
    "load_config",
    "message_id_of",
    "parse_config",
]
