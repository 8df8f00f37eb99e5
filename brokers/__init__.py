"""Broker adapters behind one small protocol, plus an in-memory broker for processor tests."""

from brokers._expose import Expose
from brokers._factory import create_broker
from brokers._lazy import MissingClient
from brokers._native import NativeProperties
from brokers._protocol import Broker, OutgoingMessage, PublishResult
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
from brokers.memory import MemoryBroker, MemorySettings
from brokers.ordering import NOT_SENT, publish_in_order, waves
from brokers.settings import AnyBrokerSettings

__all__ = [
    "NOT_SENT",
    "AnyBrokerSettings",
    "Broker",
    "BrokerSettings",
    "EmbeddedServer",
    "EventFilter",
    "EventRoute",
    "Expose",
    "MemoryBroker",
    "MemorySettings",
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
    "waves",
]
