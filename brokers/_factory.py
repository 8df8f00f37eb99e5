"""Build the adapter for a broker's settings. Each adapter (and its client library) is
imported only here, when a broker of its kind is opened, so a missing optional library only
matters for the broker kinds a config names."""

from __future__ import annotations

from brokers._lazy import import_adapter
from brokers._protocol import Broker
from brokers._settings import BrokerSettings
from brokers.memory import MemoryBroker, MemorySettings

__all__ = ["create_broker"]


def create_broker(name: str, settings: BrokerSettings) -> Broker:
    """A fresh, unconnected adapter for ``settings``.

    Raises ``MissingClient`` (a ``ConfigError``) naming the pip extra when the kind's client
    library is not installed.
    """
    if isinstance(settings, MemorySettings):
        return MemoryBroker(name)
    if not settings.adapter:
        raise TypeError(f"no adapter for broker type {settings.type!r}")
    adapter = import_adapter(settings.adapter, kind=settings.type, extra=settings.extra)
    broker: Broker = adapter(name, settings)
    return broker
