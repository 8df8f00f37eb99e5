"""drain per broker: the same backlog drained by ``router serve`` into each kind of broker.

Every broker is the one the test suite uses (see tests/contract/harnesses.py): NATS
JetStream, RabbitMQ and Redis as running on the machine; Kafka is tansu (in memory, no
idempotent producer) and Service Bus the AMQP 1.0 peer, both started here. The rate is
taken from the database's clock, from the first claim to the last row marked published, so
one method serves every broker; the messages are then counted at the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import asyncpg

from bench._common import RouterProcess, fresh_database
from tests.contract.harnesses import (
    Harness,
    KafkaHarness,
    NatsHarness,
    RabbitHarness,
    RedisHarness,
    ServiceBusHarness,
)
from tests.peers.kafka import TansuPeer
from tests.peers.servicebus import ServiceBusPeer
from tests.services import free_port

__all__ = ["KINDS", "NOTES", "drain_into", "harnesses"]

KINDS = ("nats", "kafka", "rabbitmq", "redis", "servicebus")

NOTES = {
    "nats": "JetStream, memory stream",
    "kafka": "tansu (in memory), acks=all, idempotence off",
    "rabbitmq": "publisher confirms, persistent messages",
    "redis": "XADD",
    "servicebus": "azure-servicebus SDK against the Python AMQP 1.0 peer",
}

ELAPSED = """
SELECT count(*) FILTER (WHERE status = 'published'),
       extract(epoch FROM max(published_at) - min(last_attempt_at))::float8
FROM router_outbox
"""


@contextlib.asynccontextmanager
async def harnesses(kinds: Sequence[str]) -> AsyncIterator[dict[str, Callable[[], Harness]]]:
    """Per broker kind, a maker of harnesses (each with fresh destinations), with the Kafka
    and Service Bus peers running; everything made is cleaned up afterwards."""
    made: list[Harness] = []
    with contextlib.ExitStack() as stack:
        makers = {kind: _maker(kind, stack, made) for kind in kinds}
        try:
            yield makers
        finally:
            for harness in made:
                with contextlib.suppress(Exception):
                    await harness.cleanup()


def _maker(kind: str, stack: contextlib.ExitStack, made: list[Harness]) -> Callable[[], Harness]:
    make: Callable[[], Harness]
    if kind == "nats":
        make = NatsHarness
    elif kind == "rabbitmq":
        make = RabbitHarness
    elif kind == "redis":
        make = RedisHarness
    elif kind == "kafka":
        tansu = TansuPeer(free_port())
        tansu.start()
        stack.callback(tansu.stop)
        make = functools.partial(KafkaHarness, tansu.bootstrap)
    else:
        peer = ServiceBusPeer(port=free_port())
        peer.start()
        stack.callback(peer.stop)
        make = functools.partial(ServiceBusHarness, peer)

    def remembered() -> Harness:
        harness = make()
        made.append(harness)
        return harness

    return remembered


async def drain_into(
    harness: Harness, events: int, workers: int, stage: Any, timeout: float = 600
) -> dict[str, Any]:
    """Drain a fresh backlog of ``events`` into the harness's broker; events/s and arrivals."""
    broker = harness.config(internal=True)
    destination = harness.destination("order_placed")
    await harness.prepare(destination)
    async with fresh_database(f"drain_{harness.kind}") as url:
        await stage(url, {"events": broker}, events)
        config = {
            "service": "bench",
            "databases": {"main": url},
            "brokers": {"events": broker},
            "outbox": {"batch_size": 500},
            "http": {"enabled": False},
        }
        with RouterProcess(config, "--workers", str(workers)):
            published, seconds = await _wait_published(url, events, timeout)
        arrived = len(await harness.arrived(destination, events, timeout=120))
    return {
        "events_per_second": round(published / seconds) if seconds else None,
        "seconds": round(seconds, 3),
        "arrived": arrived,
    }


async def _wait_published(url: str, events: int, timeout: float) -> tuple[int, float]:
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            published, seconds = await conn.fetchrow(ELAPSED)
            if published >= events or time.monotonic() > deadline:
                return published, seconds or 0.0
            await asyncio.sleep(0.1)
    finally:
        await conn.close()
