"""Build the adapter for a broker's settings; adapters are imported only when used, so a
missing optional client library only matters for the broker kinds a config names."""

from __future__ import annotations

from brokers._protocol import Broker
from brokers._settings import BrokerSettings
from brokers.kafka._settings import KafkaSettings
from brokers.memory import MemoryBroker, MemorySettings
from brokers.nats._settings import NatsSettings
from brokers.rabbitmq._settings import RabbitSettings
from brokers.redis._settings import RedisSettings
from brokers.servicebus._settings import ServiceBusSettings

__all__ = ["create_broker"]


def create_broker(name: str, settings: BrokerSettings) -> Broker:
    """A fresh, unconnected adapter for ``settings``."""
    if isinstance(settings, NatsSettings):
        from brokers.nats import NatsBroker

        return NatsBroker(name, settings)
    if isinstance(settings, KafkaSettings):
        from brokers.kafka import KafkaBroker

        return KafkaBroker(name, settings)
    if isinstance(settings, RabbitSettings):
        from brokers.rabbitmq import RabbitBroker

        return RabbitBroker(name, settings)
    if isinstance(settings, RedisSettings):
        from brokers.redis import RedisBroker

        return RedisBroker(name, settings)
    if isinstance(settings, ServiceBusSettings):
        from brokers.servicebus import ServiceBusBroker

        return ServiceBusBroker(name, settings)
    if isinstance(settings, MemorySettings):
        return MemoryBroker(name)
    raise TypeError(f"no adapter for broker type {settings.type!r}")
