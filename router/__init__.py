"""outbox-router: reliable event publishing from a relational database to message brokers.

The names below are imported on first use (PEP 562), not with the package: every process of
``router serve`` imports ``router``, and a worker must be claiming within a few hundred
milliseconds of its start, which leaves no time for the write path's SQLAlchemy or for
modules a command does not use.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

__version__ = "0.1.0"

if _TYPE_CHECKING:
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
        ConfigDeprecationWarning,
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
    from router.relay.processor import Processor, ProcessorStats
    from router.serve.runner import Runner
    from router.write.entities import RaisesEvents
    from router.write.events import Event, EventSpec, correlation, current_correlation_id
    from router.write.inbox import Inbox, inbox_middleware, message_id_of
    from router.write.outbox import Outbox, Transaction
    from router.write.sync import SyncOutbox

_HOMES = {
    "router._yaml": ("load_config", "parse_config"),
    "router.config": (
        "DatabaseSettings",
        "HttpSettings",
        "OutboxSettings",
        "RetrySettings",
        "RouterConfig",
    ),
    "router.errors": (
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
    ),
    "router.serve.runner": ("Runner",),
    "router.relay.processor": ("Processor", "ProcessorStats"),
    "router.write.events": ("Event", "EventSpec", "correlation", "current_correlation_id"),
    "router.write.inbox": ("Inbox", "inbox_middleware", "message_id_of"),
    "router.write.outbox": ("Outbox", "Transaction"),
    "router.write.sync": ("SyncOutbox",),
    "router.write.entities": ("RaisesEvents",),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
# Every name of __all__ but __version__ has a home (tests/unit/test_lazy_imports.py).

__all__ = [
    "BrokerError",
    "BrokerUnavailable",
    "ConfigDeprecationWarning",
    "ConfigError",
    "DatabaseError",
    "DatabaseSettings",
    "DowncastError",
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
    "RaisesEvents",
    "RetrySettings",
    "RouterConfig",
    "RouterError",
    "Runner",
    "SchemaError",
    "StagingError",
    "SyncOutbox",
    "Transaction",
    "__version__",
    "correlation",
    "current_correlation_id",
    "inbox_middleware",
    "load_config",
    "message_id_of",
    "parse_config",
]


def __getattr__(name: str) -> _Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'router' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return __all__
