"""The contract suite's fixture: each test that takes ``harness`` runs once per broker kind,
against its real peer (a missing service fails under CI=true, see tests/services.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.contract.harnesses import Harness, harness_for
from tests.services import NATS, RABBITMQ, REDIS, require

KINDS = ["nats", "kafka", "rabbitmq", "redis", "servicebus"]
# The services that run outside the tests; the Kafka and Service Bus peers start in-process.
SERVICES = {"nats": ("NATS", NATS), "rabbitmq": ("RabbitMQ", RABBITMQ), "redis": ("Redis", REDIS)}


@pytest.fixture(params=KINDS)
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    kind: str = request.param
    if kind in SERVICES:
        require(*SERVICES[kind])
    async with harness_for(kind, request) as h:
        yield h
