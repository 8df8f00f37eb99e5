"""Broker adapters behind one small protocol, plus an in-memory broker for processor tests.

This root is what the core (``router``) imports: the common base and union of the settings
and kind-neutral helpers, and no kind's own settings class (``brokers.settings`` and each
kind's package export those), so the core cannot branch on a kind.
"""

from brokers._expose import Expose
from brokers._factory import create_broker
from brokers._lazy import MissingClient
from brokers._native import NativeProperties
from brokers._protocol import AtomicBroker, Broker, OutgoingMessage, PublishResult, unit_verdict
from brokers._settings import (
    BrokerSettings,
    EmbeddedServer,
    EventFilter,
    EventRoute,
    OnBacklog,
    RateLimit,
    ServerInUse,
    UnsetSecret,
    redact_url,
)
from brokers.memory import MemoryBroker
from brokers.ordering import NOT_SENT, publish_in_order, waves
from brokers.settings import AnyBrokerSettings

__all__ = [
    "NOT_SENT",
    "AnyBrokerSettings",
    "AtomicBroker",
    "Broker",
    "BrokerSettings",
    "EmbeddedServer",
    "EventFilter",
    "EventRoute",
    "Expose",
    "MemoryBroker",
    "MissingClient",
    "NativeProperties",
    "OnBacklog",
    "OutgoingMessage",
    "PublishResult",
    "RateLimit",
    "ServerInUse",
    "UnsetSecret",
    "create_broker",
    "publish_in_order",
    "redact_url",
    "unit_verdict",
    "waves",
]
