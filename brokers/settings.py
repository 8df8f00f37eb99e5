"""Every broker kind's settings, as one discriminated union on ``type`` (used by config)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from brokers._settings import BrokerSettings, EventFilter, EventRoute, redact_url
from brokers.kafka import KafkaSasl, KafkaSettings
from brokers.memory import MemorySettings
from brokers.nats import NatsEmbedded, NatsSettings, NatsStream
from brokers.rabbitmq import RabbitExchange, RabbitSettings
from brokers.redis import RedisSettings
from brokers.servicebus import ServiceBusSettings

__all__ = [
    "AnyBrokerSettings",
    "BrokerSettings",
    "EventFilter",
    "EventRoute",
    "KafkaSasl",
    "KafkaSettings",
    "MemorySettings",
    "NatsEmbedded",
    "NatsSettings",
    "NatsStream",
    "RabbitExchange",
    "RabbitSettings",
    "RedisSettings",
    "ServiceBusSettings",
    "redact_url",
]

# ``type: memory`` is the test broker, not one to deploy. It stays in the union a config can
# name because users' unit tests of code built on the processor configure it
# (docs/configuration.md), as the project's own tests do through the same loaders, in fresh
# interpreters too (subprocesses), where only the production union is there to parse it.
AnyBrokerSettings = Annotated[
    NatsSettings
    | KafkaSettings
    | RabbitSettings
    | RedisSettings
    | ServiceBusSettings
    | MemorySettings,  # for tests only
    Field(discriminator="type"),
]
