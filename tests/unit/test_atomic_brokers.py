"""Which adapters have an atomic write (``brokers.AtomicBroker``): those whose broker stores a
group of messages all or none (a JetStream batch, a Redis MULTI/EXEC, a Service Bus batch, and
the in-memory broker that stands in for them); Kafka and RabbitMQ, whose adapters write message
by message, do not claim one. Each adapter is built from settings, unconnected."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter

from brokers import AnyBrokerSettings, AtomicBroker, Broker, create_broker

SETTINGS: dict[str, dict[str, Any]] = {
    "nats": {"type": "nats", "stream": {"name": "ORDERS", "subjects": ["orders.>"]}},
    "redis": {"type": "redis"},
    "servicebus": {
        "type": "servicebus",
        "connection_string": "Endpoint=sb://localhost:5673;SharedAccessKeyName=x;"
        "SharedAccessKey=y;UseDevelopmentEmulator=true;",
    },
    "memory": {"type": "memory"},
    "rabbitmq": {"type": "rabbitmq", "exchange": {"name": "events"}},
    "kafka": {"type": "kafka"},
}
ATOMIC = {"nats": True, "redis": True, "servicebus": True, "memory": True}


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_only_adapters_with_an_atomic_write_are_atomic_brokers(kind: str) -> None:
    settings = TypeAdapter(AnyBrokerSettings).validate_python(SETTINGS[kind])
    broker = create_broker("partner", settings)
    assert isinstance(broker, Broker)
    assert isinstance(broker, AtomicBroker) is ATOMIC.get(kind, False)
    if isinstance(broker, AtomicBroker):
        assert broker.max_unit >= 1000
