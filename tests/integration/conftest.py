"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.contract.harnesses import (
    Harness,
    KafkaHarness,
    NatsHarness,
    RabbitHarness,
    RedisHarness,
    ServiceBusHarness,
)
from tests.peers.servicebus import ServiceBusPeer
from tests.services import RABBITMQ, REDIS, free_port, require


@pytest.fixture
async def partners(kafka_peer: str) -> AsyncIterator[dict[str, Harness]]:
    require("RabbitMQ", RABBITMQ)
    require("Redis", REDIS)
    peer = ServiceBusPeer(port=free_port())  # its own: this test stops and restarts it
    peer.start()
    harnesses: dict[str, Harness] = {
        "events": NatsHarness(),
        "kafka": KafkaHarness(kafka_peer),
        "servicebus": ServiceBusHarness(peer),
        "rabbitmq": RabbitHarness(),
        "redis": RedisHarness(),
    }
    try:
        yield harnesses
    finally:
        for harness in harnesses.values():
            await harness.cleanup()
        peer.stop()
