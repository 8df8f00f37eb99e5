"""Build the adapter for a broker's settings; adapters are imported only when used."""

from __future__ import annotations

from brokers._protocol import Broker
from brokers._settings import BrokerSettings
from brokers.memory import MemoryBroker, MemorySettings
from brokers.nats._settings import NatsSettings

__all__ = ["create_broker"]


def create_broker(name: str, settings: BrokerSettings) -> Broker:
    """A fresh, unconnected adapter for ``settings``."""
    if isinstance(settings, NatsSettings):
        from brokers.nats import NatsBroker

        return NatsBroker(name, settings)
    if isinstance(settings, MemorySettings):
        return MemoryBroker(name)
    raise TypeError(f"no adapter for broker type {settings.type!r}")
